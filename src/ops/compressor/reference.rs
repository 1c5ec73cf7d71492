//! Compressor reference: one whole sequence, every step in f64 except the bf16 latent rounding
//! (part of the math) and the final f32 values handed to the (shared, bit-exact) record encoders.

use super::{CarryState, Compressed, Compressor, CompressorBatch, PooledWeights};
use crate::error::Result;
use crate::formats::page::{block_table_slot, PageLayout};
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
    w: &PooledWeights,
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

/// The bf16-valued latent of one group in f64: pool (ratio 1: `kv0` itself; ratio 2: the
/// per-channel softmax gate of `(kv0, s0)` and `pair = (kv1, s0, s1)`), RMSNorm, bf16 rounding.
pub fn latent_of_group(
    eps: f64,
    w: &PooledWeights,
    kv0: &[f32],
    pair: Option<(&[f32], &[f32], &[f32])>,
) -> Vec<f32> {
    let pooled: Vec<f64> = (0..KV_DIM)
        .map(|c| match pair {
            None => kv0[c] as f64,
            Some((kv1, s0, s1)) => {
                let (s0, s1) = (s0[c] as f64, s1[c] as f64);
                let mx = s0.max(s1);
                let (e0, e1) = ((s0 - mx).exp(), (s1 - mx).exp());
                (e0 * kv0[c] as f64 + e1 * kv1[c] as f64) / (e0 + e1)
            }
        })
        .collect();
    rms_f64(&pooled, w.norm, eps)
        .iter()
        .map(|&v| half::bf16::from_f32(v as f32).to_f32())
        .collect()
}

/// Compresses tokens `start_pos ..` (start_pos a multiple of `ratio`) in one go.
pub fn compress<'a>(
    ratio: usize,
    eps: f64,
    rope: &Rope,
    w: &PooledWeights,
    kv: &'a [f32],
    score: Option<&'a [f32]>,
    start_pos: usize,
) -> RefCompressed {
    let t = kv.len() / KV_DIM;
    let groups = t / ratio;
    let mut latent = Vec::with_capacity(groups * KV_DIM);
    let mut main_kv = Vec::with_capacity(groups * KV_DIM);
    let mut index_k = Vec::with_capacity(groups * INDEX_DIM);
    for g in 0..groups {
        let row = |i: usize, x: &'a [f32]| &x[i * KV_DIM..][..KV_DIM];
        let (first, pair) = if ratio == 1 {
            (row(g, kv), None)
        } else {
            let s = score.expect("ratio 2 needs scores");
            (
                row(2 * g, kv),
                Some((row(2 * g + 1, kv), row(2 * g, s), row(2 * g + 1, s))),
            )
        };
        latent.extend(latent_of_group(eps, w, first, pair));
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

/// One entry written by [`compress_paged`], before quantisation (f64).
#[derive(Debug, Clone, PartialEq)]
pub struct PagedEntry {
    /// Request (row of the block table).
    pub request: usize,
    /// Entry id j (its group starts at token j·m).
    pub entry: i64,
    /// The global slot it went to in both pools (`None`: unmapped block, not written).
    pub slot: Option<usize>,
    /// RoPE(latent) (512).
    pub main_kv: Vec<f64>,
    /// Index K (128).
    pub index_k: Vec<f64>,
}

/// The batched, paged compressor (the CUDA kernel's contract) in f64: for every request, the
/// entries its tokens complete (with the carried half pair of `state` in front for ratio 2) are
/// computed as [`compress`] computes them and written, as f32 rounded and encoded by the CPU codecs,
/// to their slot of `main_pages` (NVFP4-DS) and `index_pages` (MXFP4); `state` then carries each
/// request's trailing unpaired token. Returns the entries in request order.
///
/// Errors: those of [`CompressorBatch::plan`]; nothing is written on error.
pub fn compress_paged(
    c: &Compressor,
    b: &CompressorBatch,
    state: &mut CarryState,
    main_pages: &mut [u8],
    index_pages: &mut [u8],
) -> Result<Vec<PagedEntry>> {
    b.plan(c.ratio, Some(state), main_pages.len(), index_pages.len())?;
    let main = PageLayout {
        format: RecordFormat::Nvfp4Ds,
        slots: b.page_slots,
    };
    let index = PageLayout {
        format: RecordFormat::Mxfp4Index,
        slots: b.page_slots,
    };
    let m = c.ratio as i64;
    let mut out = Vec::new();
    for r in 0..b.start_pos.len() {
        let t0 = b.cu_tokens[r] as usize;
        let n = (b.cu_tokens[r + 1] - b.cu_tokens[r]) as i64;
        let s = b.start_pos[r] as i64;
        let carried = state.kv_score[r * 2 * KV_DIM..(r + 1) * 2 * KV_DIM].to_vec();
        // Token at absolute position p: the carried one before `s`, else row t0 + (p − s).
        let tok = |p: i64| -> (&[f32], &[f32]) {
            if p < s {
                (&carried[..KV_DIM], &carried[KV_DIM..])
            } else {
                let i = t0 + (p - s) as usize;
                let sc = b.score.map_or(&[][..], |sc| &sc[i * KV_DIM..][..KV_DIM]);
                (&b.kv[i * KV_DIM..][..KV_DIM], sc)
            }
        };
        let bt = &b.block_table[r * b.max_blocks..(r + 1) * b.max_blocks];
        for j in s / m..(s + n) / m {
            let lat = if m == 1 {
                latent_of_group(c.eps, &c.w, tok(j).0, None)
            } else {
                let ((k0, s0), (k1, s1)) = (tok(2 * j), tok(2 * j + 1));
                latent_of_group(c.eps, &c.w, k0, Some((k1, s0, s1)))
            };
            let (mkv, ik) = from_latent(c.eps, &c.rope, &c.w, &lat, (j * m) as usize);
            let slot = block_table_slot(bt, j, b.page_slots);
            if let Some(sl) = slot {
                let m32: Vec<f32> = mkv.iter().map(|&v| v as f32).collect();
                let i32_: Vec<f32> = ik.iter().map(|&v| v as f32).collect();
                main.encode_into_pages(&m32, &[sl as i64], main_pages)?;
                index.encode_into_pages(&i32_, &[sl as i64], index_pages)?;
            }
            out.push(PagedEntry {
                request: r,
                entry: j,
                slot,
                main_kv: mkv,
                index_k: ik,
            });
        }
        if m == 2 && n > 0 {
            let last = s + n - 1;
            let st = &mut state.kv_score[r * 2 * KV_DIM..(r + 1) * 2 * KV_DIM];
            if last % 2 == 0 {
                let i = t0 + n as usize - 1;
                st[..KV_DIM].copy_from_slice(&b.kv[i * KV_DIM..][..KV_DIM]);
                if let Some(sc) = b.score {
                    st[KV_DIM..].copy_from_slice(&sc[i * KV_DIM..][..KV_DIM]);
                }
                state.pos[r] = last as i32;
            } else {
                st.fill(0.0);
                state.pos[r] = -1;
            }
        }
    }
    Ok(out)
}
