//! `csa2 op` end to end: inputs written as .npy, the binary run, outputs read back and compared with
//! the library call; bad inputs produce errors that name the file, expected and found shape.

use csa2_harness::npy;
use std::path::Path;
use std::process::Command;

fn csa2(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_csa2"))
        .args(args)
        .output()
        .expect("runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn op(name: &str, dir: &Path, out: &Path, reference: bool) -> (bool, String) {
    let mut a = vec![
        "op",
        name,
        "--in",
        dir.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    if reference {
        a.push("--reference");
    }
    csa2(&a)
}

#[test]
fn candidates_fast_and_reference_agree_and_shape_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (i, o, r) = (
        dir.path().join("in"),
        dir.path().join("out"),
        dir.path().join("ref"),
    );
    std::fs::create_dir(&i).unwrap();
    let n = 40;
    let logits: Vec<f32> = (0..2 * n).map(|j| ((j * 37) % 11) as f32).collect();
    npy::write(&i.join("logits.npy"), &[2, n], &logits).unwrap();
    npy::write(&i.join("positions.npy"), &[2], &[39i64, 20]).unwrap();
    std::fs::write(i.join("params.json"), r#"{"ratio": 1, "num_blocks": 3}"#).unwrap();
    assert!(op("candidates", &i, &o, false).0);
    assert!(op("candidates", &i, &r, true).0);
    let a = npy::read::<i32>(&o.join("blocks.npy")).unwrap();
    let b = npy::read::<i32>(&r.join("blocks.npy")).unwrap();
    assert_eq!(a.shape, vec![2, 3]);
    assert_eq!(a, b);
    assert_eq!(a.data[0], 4, "newest block pinned first");
    // Wrong rank: the message names the file and both shapes.
    npy::write(&i.join("positions.npy"), &[1, 2], &[39i64, 20]).unwrap();
    let (ok, err) = op("candidates", &i, &o, false);
    assert!(!ok);
    assert!(
        err.contains("positions.npy") && err.contains("[T=2]") && err.contains("[1, 2]"),
        "{err}"
    );
    // Wrong dtype.
    npy::write(&i.join("positions.npy"), &[2], &[39f32, 20.0]).unwrap();
    let (ok, err) = op("candidates", &i, &o, false);
    assert!(
        !ok && err.contains("int64") && err.contains("positions.npy"),
        "{err}"
    );
}

#[test]
fn attention_needs_exactly_one_main_kv_and_unknown_ops_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (i, o) = (dir.path().join("in"), dir.path().join("out"));
    std::fs::create_dir(&i).unwrap();
    npy::write(&i.join("q.npy"), &[1, 64, 512], &vec![0.5f32; 64 * 512]).unwrap();
    npy::write(&i.join("topk.npy"), &[1, 2], &[0i32, -1]).unwrap();
    npy::write(&i.join("sink.npy"), &[64], &[0f32; 64]).unwrap();
    npy::write(&i.join("positions.npy"), &[1], &[3i64]).unwrap();
    npy::write(&i.join("swa.npy"), &[4, 512], &vec![1f32; 4 * 512]).unwrap();
    let (ok, err) = op("attention", &i, &o, false);
    assert!(
        !ok && err.contains("main_kv.npy or main_kv_nvfp4.npy"),
        "{err}"
    );
    npy::write(&i.join("main_kv.npy"), &[2, 512], &vec![1f32; 2 * 512]).unwrap();
    let (ok, err) = op("attention", &i, &o, false);
    assert!(ok, "{err}");
    let out = npy::read::<f32>(&o.join("out.npy")).unwrap();
    // All rows equal 1 → the output is 1 · (1 − sink share).
    let lse = npy::read::<f32>(&o.join("lse.npy")).unwrap();
    assert_eq!(out.shape, vec![1, 64, 512]);
    let z = 0.5 * 512.0 / 512f32.sqrt();
    let want = 5.0 * z.exp() / (5.0 * z.exp() + 1.0);
    assert!(
        (out.data[0] - want).abs() < 1e-5,
        "{} vs {want}",
        out.data[0]
    );
    assert!((lse.data[0] - (z + 5f32.ln())).abs() < 1e-4);
    let (ok, err) = csa2(&["op", "nope", "--in", ".", "--out", o.to_str().unwrap()]);
    // clap refuses the name and lists the ops.
    assert!(
        !ok && err.contains("invalid value 'nope'") && err.contains("attention"),
        "{err}"
    );
}
