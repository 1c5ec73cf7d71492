//! `csa2 make-checkpoint` → `csa2 run --weights` round trip through the binary: the run
//! loads the checkpoint's tensors and its output depends on them; a checkpoint that lacks a tensor
//! or has the wrong scale fails with a message naming the problem.
//!
//! Each run is one turn of a few dozen tokens through the 40-layer tiny stack (seconds).

use safetensors::{tensor::TensorView, SafeTensors};
use std::path::Path;
use std::process::{Command, Output};

fn csa2(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_csa2"))
        .args(args)
        .output()
        .expect("csa2 runs")
}

fn make(dir: &Path, seed: u64) {
    let out = csa2(&[
        "make-checkpoint",
        "--out",
        dir.to_str().unwrap(),
        "--scale",
        "tiny",
        "--seed",
        &seed.to_string(),
    ]);
    assert!(
        out.status.success(),
        "make-checkpoint: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `csa2 run --weights DIR` for one short turn; extra flags appended.
fn run(dir: &Path, json: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "run",
        "--weights",
        dir.to_str().unwrap(),
        "--turns",
        "1",
        "--token-scale",
        "0.005",
        "--decode-max",
        "2",
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    csa2(&args)
}

/// The `output_sha256` of a successful run's JSON, after checking the run's shape.
fn digest(dir: &Path, json: &Path) -> String {
    let out = run(dir, json, &[]);
    assert!(
        out.status.success(),
        "run --weights: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("checkpoint weights"), "{stdout}");
    // One of a thing is singular ("1 turn", "1 block"; the run printed "1 blocks in use").
    assert!(stdout.contains("1 turn of"), "{stdout}");
    assert!(!stdout.contains(" 1 blocks"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let turns = v["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 1);
    assert!(turns[0]["prefill_rows"].as_u64().unwrap() > 0);
    assert_eq!(turns[0]["generated_tokens"].as_u64().unwrap(), 2);
    let d = v["output_sha256"].as_str().unwrap().to_string();
    assert_eq!(d.len(), 64, "{d}");
    d
}

#[test]
fn run_uses_the_checkpoint_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, a2, b) = (
        tmp.path().join("a"),
        tmp.path().join("a2"),
        tmp.path().join("b"),
    );
    make(&a, 1);
    make(&a2, 1);
    make(&b, 2);
    let da = digest(&a, &tmp.path().join("a.json"));
    let da2 = digest(&a2, &tmp.path().join("a2.json"));
    let db = digest(&b, &tmp.path().join("b.json"));
    assert_eq!(da, da2, "same seed, separately written: identical outputs");
    assert_ne!(da, db, "another seed's weights must change the outputs");
}

#[test]
fn a_missing_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    make(&dir, 3);
    // Drop one mHC tensor from its shard and from the index.
    let name = "layers.5.hc_attn_fn";
    let index = dir.join("model.safetensors.index.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    let map = v["weight_map"].as_object_mut().unwrap();
    let shard = dir.join(map.remove(name).unwrap().as_str().unwrap());
    std::fs::write(&index, v.to_string()).unwrap();
    let bytes = std::fs::read(&shard).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let keep: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != name)
        .collect();
    safetensors::serialize_to_file(keep, None, &shard).unwrap();
    let out = run(&dir, &tmp.path().join("x.json"), &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(name), "{err}");
    assert!(!tmp.path().join("x.json").exists());
}

#[test]
fn a_partial_checkpoint_names_the_first_absent_layer_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let out = csa2(&[
        "make-checkpoint",
        "--out",
        dir.to_str().unwrap(),
        "--layers",
        "0..39",
    ]);
    assert!(out.status.success());
    let out = run(&dir, &tmp.path().join("x.json"), &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("layers.39."), "{err}");
}

#[test]
fn a_checkpoint_of_the_wrong_scale_fails_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    make(&dir, 4);
    let out = run(&dir, &tmp.path().join("x.json"), &["--scale", "full"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("config.json") && err.contains("hidden 256") && err.contains("hidden 5120"),
        "{err}"
    );
}
