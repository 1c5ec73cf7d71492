//! Attention reference in f64: each head's softmax over the attended rows written out.

use super::{AttentionInputs, AttentionParams, KvRows, TokenRows};
use crate::formats::KV_DIM;

/// Returns `(out, lse)` as f64: out (tokens, heads, 512), lse (tokens, heads), for the rows of
/// [`super::plan`].
pub fn attention(
    p: &AttentionParams,
    inp: &AttentionInputs,
    rows: &[TokenRows],
    main: KvRows,
    swa: KvRows,
) -> (Vec<f64>, Vec<f64>) {
    attention_rows(p, inp.q, inp.sink, rows, main, swa)
}

/// Returns `(out, lse)` as f64: out (tokens, heads, 512), lse (tokens, heads), for `q` (tokens,
/// heads, 512), `sink` (heads) and the rows of [`super::plan`] or [`super::plan_indexed`].
pub fn attention_rows(
    p: &AttentionParams,
    q: &[f32],
    sink: &[f32],
    rows: &[TokenRows],
    main: KvRows,
    swa: KvRows,
) -> (Vec<f64>, Vec<f64>) {
    let h = p.heads;
    let mut out = vec![0f64; rows.len() * h * KV_DIM];
    let mut lse = vec![f64::NEG_INFINITY; rows.len() * h];
    let scale = p.scale as f64;
    let mut buf = vec![0f32; KV_DIM];
    for (ti, r) in rows.iter().enumerate() {
        let mut keys: Vec<Vec<f64>> = Vec::new();
        for &j in &r.main {
            main.row(j, &mut buf);
            keys.push(buf.iter().map(|&v| v as f64).collect());
        }
        for &s in &r.swa {
            swa.row(s, &mut buf);
            keys.push(buf.iter().map(|&v| v as f64).collect());
        }
        if keys.is_empty() {
            continue;
        }
        for hi in 0..h {
            let q = &q[(ti * h + hi) * KV_DIM..][..KV_DIM];
            let z: Vec<f64> = keys
                .iter()
                .map(|k| scale * k.iter().zip(q).map(|(&a, &b)| a * b as f64).sum::<f64>())
                .collect();
            let a = sink[hi] as f64;
            let m = z.iter().copied().fold(a, f64::max);
            let e: Vec<f64> = z.iter().map(|&v| (v - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            let den = sum + (a - m).exp();
            let o = &mut out[(ti * h + hi) * KV_DIM..][..KV_DIM];
            for (ej, k) in e.iter().zip(&keys) {
                for (od, &kd) in o.iter_mut().zip(k) {
                    *od += ej / den * kd;
                }
            }
            lse[ti * h + hi] = m + sum.ln();
        }
    }
    (out, lse)
}
