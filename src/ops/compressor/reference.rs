//! Compressor reference: one whole sequence, every step in f64 except the bf16 latent rounding
//! (part of the math) and the final f32 values handed to the (shared, bit-exact) record encoders.

use super::{Compressed, CompressorWeights};
use crate::formats::{encode_rows, RecordFormat, INDEX_DIM, KV_DIM};
use crate::ops::rope::{reference::rotate_f64, Direction, Rope};

/// Reference outputs: the f64 values plus records encoded from their f32 rounding.
#[derive(Debug, Clone)]
pub struct RefCompressed {
    /// (G, 512) bf16-valued latent.
    pub latent: Vec<f32>,
    /// (G, 512) RoPE(latent) in f64.
    pub main_kv: Vec<f64>,
    /// (G, 128) index K in f64.
    pub index_k: Vec<f64>,
    /// The f32 outputs and records (quantise → dequantise reference).
    pub f32: Compressed,
}

fn rms_f64(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(&v, &w)| v * r * w as f64).collect()
}

/// Main KV and index K (f64) of one entry from its latent, the group starting at token `pos`.
///
/// Exposed so a comparison can continue from the fast path's latent when a bf16 rounding step
/// differed (see `tolerance::BF16_ROUNDED`).
pub fn from_latent(
    eps: f64,
    rope: &Rope,
    w: &CompressorWeights,
    lat: &[f32],
    pos: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut mkv: Vec<f64> = lat.iter().map(|&v| v as f64).collect();
    rotate_f64(
        rope,
        &mut mkv[KV_DIM - rope.rope_dim()..],
        pos as u64,
        Direction::Forward,
    );
    let y: Vec<f64> = (0..INDEX_DIM)
        .map(|i| {
            (0..KV_DIM)
                .map(|c| w.wk[i * KV_DIM + c] as f64 * lat[c] as f64)
                .sum()
        })
        .collect();
    let mut ik = rms_f64(&y, w.k_norm, eps);
    rotate_f64(
        rope,
        &mut ik[INDEX_DIM - rope.rope_dim()..],
        pos as u64,
        Direction::Forward,
    );
    (mkv, ik)
}

/// Compresses tokens `start_pos ..` (start_pos a multiple of `ratio`) in one go.
pub fn compress(
    ratio: usize,
    eps: f64,
    rope: &Rope,
    w: &CompressorWeights,
    kv: &[f32],
    score: Option<&[f32]>,
    start_pos: usize,
) -> RefCompressed {
    let t = kv.len() / KV_DIM;
    let groups = t / ratio;
    let mut latent = Vec::with_capacity(groups * KV_DIM);
    let mut main_kv = Vec::with_capacity(groups * KV_DIM);
    let mut index_k = Vec::with_capacity(groups * INDEX_DIM);
    for g in 0..groups {
        let pooled: Vec<f64> = (0..KV_DIM)
            .map(|c| {
                if ratio == 1 {
                    kv[g * KV_DIM + c] as f64
                } else {
                    let s = score.expect("ratio 2 needs scores");
                    let (a, b) = ((2 * g) * KV_DIM + c, (2 * g + 1) * KV_DIM + c);
                    let (s0, s1) = (s[a] as f64, s[b] as f64);
                    let mx = s0.max(s1);
                    let (e0, e1) = ((s0 - mx).exp(), (s1 - mx).exp());
                    (e0 * kv[a] as f64 + e1 * kv[b] as f64) / (e0 + e1)
                }
            })
            .collect();
        let lat: Vec<f32> = rms_f64(&pooled, w.norm, eps)
            .iter()
            .map(|&v| half::bf16::from_f32(v as f32).to_f32())
            .collect();
        latent.extend(lat);
    }
    for (g, lat) in latent.chunks_exact(KV_DIM).enumerate() {
        let (mkv, ik) = from_latent(eps, rope, w, lat, (start_pos / ratio + g) * ratio);
        main_kv.extend(mkv);
        index_k.extend(ik);
    }
    let main_f32: Vec<f32> = main_kv.iter().map(|&v| v as f32).collect();
    let idx_f32: Vec<f32> = index_k.iter().map(|&v| v as f32).collect();
    let (mut mr, mut ir) = super::record_buffers(groups);
    encode_rows(RecordFormat::Nvfp4Ds, &main_f32, &mut mr).expect("whole rows");
    encode_rows(RecordFormat::Mxfp4Index, &idx_f32, &mut ir).expect("whole rows");
    RefCompressed {
        f32: Compressed {
            first_entry: start_pos / ratio,
            count: groups,
            latent: latent.clone(),
            main_kv: main_f32,
            main_kv_nvfp4: mr,
            index_k: idx_f32,
            index_k_mxfp4: ir,
        },
        latent,
        main_kv,
        index_k,
    }
}
