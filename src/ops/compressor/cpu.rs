//! Compressor fast path: entries in parallel; the wk projection as 16-lane dot products.

use super::{Compressed, Compressor};
use crate::formats::scalar::bf16_round;
use crate::formats::{RecordFormat, INDEX_DIM, KV_DIM, MXFP4_INDEX_BYTES, NVFP4_DS_BYTES};
use crate::ops::rope::{Direction, MAX_PAIRS};
use rayon::prelude::*;

/// Per-channel softmax gate over a pair: `w0·k0 + (1 − w0)·k1`, `w0 = 1 / (1 + e^(s1 − s0))`.
pub fn gate_pool(k0: &[f32], k1: &[f32], s0: &[f32], s1: &[f32], out: &mut [f32]) {
    for c in 0..out.len() {
        let w0 = 1.0 / (1.0 + (s1[c] - s0[c]).exp());
        out[c] = w0 * k0[c] + (1.0 - w0) * k1[c];
    }
}

/// `x · rsqrt(mean(x²) + eps) · weight` with the statistic and the product in f64, rounded once.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let r = 1.0 / (ss / x.len() as f64 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v as f64 * r * w as f64) as f32;
    }
}

/// 16-lane dot product (lane-wise partial sums vectorise without reassociating a single chain).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (ca, cb) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    acc.iter().sum()
}

/// Turns pooled groups into the compressor outputs.
pub fn finish(c: &Compressor, first_entry: usize, pooled: Vec<f32>) -> Compressed {
    let count = pooled.len() / KV_DIM;
    let mut latent = vec![0f32; count * KV_DIM];
    let mut main_kv = vec![0f32; count * KV_DIM];
    let mut index_k = vec![0f32; count * INDEX_DIM];
    let (mut main_rec, mut idx_rec) = super::record_buffers(count);
    let m = c.ratio;
    latent
        .par_chunks_mut(KV_DIM)
        .zip(main_kv.par_chunks_mut(KV_DIM))
        .zip(index_k.par_chunks_mut(INDEX_DIM))
        .zip(
            main_rec
                .par_chunks_mut(NVFP4_DS_BYTES)
                .zip(idx_rec.par_chunks_mut(MXFP4_INDEX_BYTES)),
        )
        .zip(pooled.par_chunks(KV_DIM))
        .enumerate()
        .for_each(|(g, ((((lat, mkv), ik), (mr, ir)), pool))| {
            rms_norm(pool, c.w.norm, c.eps, lat);
            for v in lat.iter_mut() {
                *v = bf16_round(*v);
            }
            let pos = ((first_entry + g) * m) as u64;
            let half = c.rope.rope_dim() / 2;
            let (mut cos, mut sin) = ([0f32; MAX_PAIRS], [0f32; MAX_PAIRS]);
            c.rope
                .cos_sin(pos, Direction::Forward, &mut cos[..half], &mut sin[..half]);
            mkv.copy_from_slice(lat);
            c.rope.rotate_row(mkv, &cos[..half], &sin[..half]);
            let (d, s) = mr.split_at_mut(256);
            RecordFormat::Nvfp4Ds.encode_row(mkv, d, s);
            let mut y = [0f32; INDEX_DIM];
            for (i, yi) in y.iter_mut().enumerate() {
                *yi = dot(&c.w.wk[i * KV_DIM..][..KV_DIM], lat);
            }
            rms_norm(&y, c.w.k_norm, c.eps, ik);
            c.rope.rotate_row(ik, &cos[..half], &sin[..half]);
            let (d, s) = ir.split_at_mut(64);
            RecordFormat::Mxfp4Index.encode_row(ik, d, s);
        });
    Compressed {
        first_entry,
        count,
        latent,
        main_kv,
        main_kv_nvfp4: main_rec,
        index_k,
        index_k_mxfp4: idx_rec,
    }
}
