//! Synthetic checkpoint → loader round trip, and the errors for missing / misshaped tensors.

use csa2::formats::scalar::{e4m3_decode, e8m0_decode};
use csa2::geometry::Role;
use csa2::weights::{
    layer_specs, scale_name,
    synth::{quantize_fp8_block, source_values, write_checkpoint},
    Checkpoint, Scale, Stored, FP8_BLOCK, INDEX_FILE,
};
use csa2::Error;
use safetensors::{tensor::TensorView, SafeTensors};
use std::path::Path;

/// Dequantized FP8 values are within half an E4M3 step of the source: relative 2^-4 for normals,
/// absolute 2^-10·scale in the subnormal range.
fn fp8_bound(w: f32, scale: f32) -> f32 {
    (w.abs() / 16.0).max(scale / 1024.0)
}

#[test]
fn tiny_geometry_keeps_the_released_plan_and_record_dims() {
    let (t, f) = (Scale::Tiny.geometry(), Scale::Full.geometry());
    assert_eq!(t.num_layers, 40);
    assert_eq!(t.head_dim, 512);
    assert_eq!(t.index_head_dim, 128);
    assert_eq!(t.hidden_size, 256);
    assert_eq!(t.layers, f.layers);
    for g in [&t, &f] {
        for l in 0..g.num_layers {
            for s in layer_specs(g, l).unwrap() {
                if s.stored == Stored::Fp8Block {
                    assert!(s.shape.iter().all(|d| d % FP8_BLOCK == 0), "{}", s.name);
                }
            }
        }
    }
}

#[test]
fn make_checkpoint_then_load_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let seed = 7;
    // Layers 0..26 cover every role: SWA-only 0–1, Full ratio 2 (2, 8, 14), Reuse, Full ratio 1
    // (20), Reindex (24).
    let w = write_checkpoint(dir.path(), Scale::Tiny, seed, 0..26).unwrap();
    assert_eq!(w.shards.len(), 3);
    let g = csa2::Geometry::from_path(&dir.path().join("config.json")).unwrap();
    assert_eq!(g, Scale::Tiny.geometry());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(INDEX_FILE)).unwrap())
            .unwrap();
    assert_eq!(index["weight_map"].as_object().unwrap().len(), w.tensors);
    assert_eq!(ck.names().count(), w.tensors);

    for l in 0..26 {
        let lw = ck.layer(&g, l).unwrap();
        let plan = &g.layers[l];
        assert_eq!(lw.role, plan.role);
        assert_eq!(lw.attn.compressor.is_some(), plan.role == Role::Full);
        assert_eq!(
            lw.attn.compressor.as_ref().map(|c| c.wgate.is_some()),
            (plan.role == Role::Full).then_some(plan.ratio == 2)
        );
        assert_eq!(
            lw.attn.indexer.is_some(),
            matches!(plan.role, Role::Full | Role::Reindex)
        );
        assert_eq!(
            lw.attn.indexer.as_ref().map(|i| i.k.is_some()),
            matches!(plan.role, Role::Full | Role::Reindex).then_some(plan.role == Role::Full)
        );
        assert_eq!(lw.hc_attn.hc_fn.len(), 24 * 4 * g.hidden_size);

        for spec in layer_specs(&g, l).unwrap() {
            let src = source_values(&spec, g.hidden_size, seed);
            let got = ck.load_f32(&spec.name, &spec.shape).unwrap();
            match spec.stored {
                Stored::F32 => assert_eq!(got, src, "{}", spec.name),
                Stored::Bf16 => {
                    for (a, b) in got.iter().zip(&src) {
                        assert_eq!(*a, half::bf16::from_f32(*b).to_f32(), "{}", spec.name);
                        assert!((a - b).abs() <= b.abs() / 256.0, "{}", spec.name);
                    }
                }
                Stored::Fp8Block => {
                    let (rows, cols) = (spec.shape[0], spec.shape[1]);
                    let (q, s) = quantize_fp8_block(&src, rows, cols);
                    let bc = cols.div_ceil(FP8_BLOCK);
                    for r in 0..rows {
                        for c in 0..cols {
                            let i = r * cols + c;
                            let sc = e8m0_decode(s[(r / FP8_BLOCK) * bc + c / FP8_BLOCK]);
                            // Tight: exactly the quantize→dequantize of the source.
                            assert_eq!(got[i], e4m3_decode(q[i]) * sc, "{} [{r},{c}]", spec.name);
                            // Loose: within FP8 rounding of the unquantized source.
                            assert!(
                                (got[i] - src[i]).abs() <= fp8_bound(src[i], sc),
                                "{} [{r},{c}]: {} vs {}",
                                spec.name,
                                got[i],
                                src[i]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Rewrites the shard holding `name` with `edit` applied (None = drop the tensor) and keeps the
/// index consistent.
fn rewrite(dir: &Path, name: &str, edit: Option<(Vec<usize>, Vec<u8>)>) {
    let index_path = dir.join(INDEX_FILE);
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let file = index["weight_map"][name].as_str().unwrap().to_string();
    let bytes = std::fs::read(dir.join(&file)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut keep: Vec<(String, TensorView)> = Vec::new();
    for (n, v) in st.tensors() {
        if n == name {
            if let Some((shape, data)) = &edit {
                let data: &'static [u8] = Box::leak(data.clone().into_boxed_slice());
                keep.push((n, TensorView::new(v.dtype(), shape.clone(), data).unwrap()));
            }
        } else {
            keep.push((n, v));
        }
    }
    if edit.is_none() {
        index["weight_map"].as_object_mut().unwrap().remove(name);
    }
    safetensors::serialize_to_file(keep, None, &dir.join(&file)).unwrap();
    std::fs::write(&index_path, serde_json::to_string(&index).unwrap()).unwrap();
}

#[test]
fn missing_and_misshaped_tensors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), Scale::Tiny, 1, 2..4).unwrap();
    let g = Scale::Tiny.geometry();
    assert!(Checkpoint::open(dir.path()).unwrap().layer(&g, 2).is_ok());

    // A missing FP8 weight.
    rewrite(dir.path(), "layers.2.attn.wkv.weight", None);
    let e = Checkpoint::open(dir.path())
        .unwrap()
        .layer(&g, 2)
        .unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("layers.2.attn.wkv.weight") && m.contains("[512, 256]"),
        "{m}"
    );

    // A missing block scale.
    rewrite(dir.path(), &scale_name("layers.3.attn.wq_a.weight"), None);
    let m = Checkpoint::open(dir.path())
        .unwrap()
        .layer(&g, 3)
        .unwrap_err()
        .to_string();
    assert!(
        m.contains("layers.3.attn.wq_a.scale") && m.contains("[2, 8]"),
        "{m}"
    );

    // A misshaped bf16 norm: [63] instead of [64].
    let dir2 = tempfile::tempdir().unwrap();
    write_checkpoint(dir2.path(), Scale::Tiny, 1, 2..3).unwrap();
    rewrite(
        dir2.path(),
        "layers.2.attn.q_norm.weight",
        Some((vec![63], vec![0u8; 126])),
    );
    let e = Checkpoint::open(dir2.path())
        .unwrap()
        .layer(&g, 2)
        .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("layers.2.attn.q_norm.weight") && m.contains("[64]") && m.contains("[63]"),
        "{m}"
    );

    // A misshaped block scale.
    rewrite(
        dir2.path(),
        "layers.2.attn.wkv.scale",
        Some((vec![16, 4], vec![127u8; 64])),
    );
    let ck = Checkpoint::open(dir2.path()).unwrap();
    let m = ck
        .load_f32("layers.2.attn.wkv.weight", &[512, 256])
        .unwrap_err()
        .to_string();
    assert!(
        m.contains("layers.2.attn.wkv.scale") && m.contains("[16, 8]") && m.contains("[16, 4]"),
        "{m}"
    );
}

#[test]
fn open_rejects_an_index_that_points_at_the_wrong_shard() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), Scale::Tiny, 2, 0..12).unwrap();
    let index_path = dir.path().join(INDEX_FILE);
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["layers.0.attn_norm.weight"] = "model-00002-of-00002.safetensors".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    let m = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(m.contains("layers.0.attn_norm.weight"), "{m}");
    assert!(Checkpoint::open(&dir.path().join("nope")).is_err());
}

/// Synthetic weights are kept in the release's dtypes: the in-memory model holds FP8
/// E4M3 + block scales, bf16 and f32 tensors exactly as a written checkpoint of the same seed
/// loads them, so `csa2 run` / `csa2 ab` without `--weights` multiply the checkpoint's values.
#[test]
fn synthetic_layers_equal_the_checkpoint_they_would_write() {
    let dir = tempfile::tempdir().unwrap();
    let g = Scale::Tiny.geometry();
    write_checkpoint(dir.path(), Scale::Tiny, 4, 0..3).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    for l in 0..3 {
        let loaded = ck.layer(&g, l).unwrap();
        let synth = csa2::backend::stack::synthetic_layer(&g, l, 4).unwrap();
        assert!(loaded == synth, "layer {l}");
        assert_eq!(synth.attn.wq_b.dtype_name(), "fp8_e4m3");
        assert_eq!(
            synth
                .attn
                .indexer
                .as_ref()
                .map(|i| i.weights_proj.dtype_name()),
            (g.layers[l].role != Role::SwaOnly && g.layers[l].role != Role::Reuse)
                .then_some("bf16")
        );
    }
}
