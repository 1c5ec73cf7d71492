//! Readable f64 CPU references for the CUDA kernels (docs/SPEC.md §1–§4), used by `tests/cuda.rs` and by
//! the GPU validation binary. Codecs come from the crate's CPU formats (`csa2::formats`), so the
//! GPU's page bytes are compared with the CPU path's bytes.
#![allow(dead_code, clippy::needless_range_loop)] // matrix maths reads best with indices

use csa2::formats::page::PageLayout;
use csa2::formats::scalar::bf16_round;
use csa2::formats::RecordFormat;

pub const KV: usize = 512;
pub const IDX: usize = 128;
pub const EPS: f64 = 1e-20;

/// A paged pool on the host: bytes plus layout.
#[derive(Clone, Debug)]
pub struct Pool {
    pub layout: PageLayout,
    pub bytes: Vec<u8>,
}

impl Pool {
    pub fn new(format: RecordFormat, slots: usize, pages: usize) -> Pool {
        let layout = PageLayout { format, slots };
        Pool {
            layout,
            bytes: vec![0u8; layout.page_bytes() * pages],
        }
    }
    pub fn page_mut(&mut self, page: usize) -> &mut [u8] {
        let pb = self.layout.page_bytes();
        &mut self.bytes[page * pb..(page + 1) * pb]
    }
    pub fn page(&self, page: usize) -> &[u8] {
        let pb = self.layout.page_bytes();
        &self.bytes[page * pb..(page + 1) * pb]
    }
    /// Writes a row at a global slot (page · slots + offset) with the CPU codec.
    pub fn write_slot(&mut self, slot: usize, row: &[f32]) {
        let (p, o) = (slot / self.layout.slots, slot % self.layout.slots);
        let lay = self.layout;
        lay.write(self.page_mut(p), o, row).unwrap();
    }
    /// Decodes the row at a global slot with the CPU codec.
    pub fn read_slot(&self, slot: usize) -> Vec<f32> {
        let (p, o) = (slot / self.layout.slots, slot % self.layout.slots);
        let mut out = vec![0f32; self.layout.format.dim()];
        self.layout.read(self.page(p), o, &mut out).unwrap();
        out
    }
}

/// Slot of logical row j through a block-table row (-1 when unmapped), as the kernels compute it.
pub fn table_slot(bt_row: &[i32], j: i64, page_slots: usize) -> Option<usize> {
    if j < 0 {
        return None;
    }
    let b = (j as usize) / page_slots;
    let blk = *bt_row.get(b)?;
    (blk >= 0).then(|| blk as usize * page_slots + j as usize % page_slots)
}

/// GPT-J interleaved RoPE on `x` (pairs (2i, 2i+1)), angle sign·pos·inv_freq[i], in f64.
pub fn rope(x: &mut [f64], pos: i64, inv_freq: &[f64], sign: f64) {
    for (i, &f) in inv_freq.iter().enumerate() {
        let ang = pos as f64 * f;
        let (s, c) = (sign * ang.sin(), ang.cos());
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

pub fn rms_norm(x: &[f64], w: &[f32]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + EPS).sqrt();
    x.iter().zip(w).map(|(v, &w)| v * r * w as f64).collect()
}

// ---- compressor ------------------------------------------------------------------------------------

pub struct CompressorRefOut {
    /// (request, entry j, RoPE'd latent before quantization) for every entry written.
    pub main_rows: Vec<(usize, i64, Vec<f32>)>,
    /// (request, entry j, index K before quantization).
    pub index_rows: Vec<(usize, i64, Vec<f32>)>,
}

/// Compressor reference: writes pages with the CPU codecs and updates the carry state, exactly the
/// contract of `Device::compress`.
#[allow(clippy::too_many_arguments)]
pub fn compressor_ref(
    ratio: usize,
    norm_w: &[f32],
    wk: &[f32],
    k_norm_w: &[f32],
    inv_freq: &[f64],
    kv: &[f32],
    score: Option<&[f32]>,
    cu_tokens: &[i32],
    start_pos: &[i32],
    block_table: &[i32],
    max_blocks: usize,
    state: &mut csa2::cuda::compressor::CarryState,
    main: &mut Pool,
    index: &mut Pool,
) -> CompressorRefOut {
    let mut out = CompressorRefOut {
        main_rows: vec![],
        index_rows: vec![],
    };
    let page_slots = main.layout.slots;
    let m = ratio as i64;
    for r in 0..start_pos.len() {
        let t0 = cu_tokens[r] as usize;
        let len = (cu_tokens[r + 1] - cu_tokens[r]) as i64;
        let s = start_pos[r] as i64;
        let tok = |p: i64| -> (Vec<f64>, Vec<f64>) {
            if p < s {
                let st = &state.kv_score[r * 2 * KV..(r + 1) * 2 * KV];
                (
                    st[..KV].iter().map(|&v| v as f64).collect(),
                    st[KV..].iter().map(|&v| v as f64).collect(),
                )
            } else {
                let row = t0 + (p - s) as usize;
                let k = kv[row * KV..(row + 1) * KV]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                let sc = score.map_or(vec![0.0; KV], |sc| {
                    sc[row * KV..(row + 1) * KV]
                        .iter()
                        .map(|&v| v as f64)
                        .collect()
                });
                (k, sc)
            }
        };
        for j in s / m..(s + len) / m {
            let pooled: Vec<f64> = if ratio == 1 {
                tok(j).0
            } else {
                let (k0, s0) = tok(2 * j);
                let (k1, s1) = tok(2 * j + 1);
                (0..KV)
                    .map(|c| {
                        let mx = s0[c].max(s1[c]);
                        let (e0, e1) = ((s0[c] - mx).exp(), (s1[c] - mx).exp());
                        let w0 = e0 / (e0 + e1);
                        w0 * k0[c] + (1.0 - w0) * k1[c]
                    })
                    .collect()
            };
            let latent: Vec<f64> = rms_norm(&pooled, norm_w)
                .into_iter()
                .map(|v| bf16_round(v as f32) as f64)
                .collect();
            let mut kidx: Vec<f64> = (0..IDX)
                .map(|o| (0..KV).map(|c| wk[o * KV + c] as f64 * latent[c]).sum())
                .collect();
            kidx = rms_norm(&kidx, k_norm_w);
            let mut lat = latent.clone();
            rope(&mut lat[448..], j * m, inv_freq, 1.0);
            rope(&mut kidx[64..], j * m, inv_freq, 1.0);
            let lat32: Vec<f32> = lat.iter().map(|&v| v as f32).collect();
            let k32: Vec<f32> = kidx.iter().map(|&v| v as f32).collect();
            let bt = &block_table[r * max_blocks..(r + 1) * max_blocks];
            if let Some(slot) = table_slot(bt, j, page_slots) {
                main.write_slot(slot, &lat32);
                index.write_slot(slot, &k32);
            }
            out.main_rows.push((r, j, lat32));
            out.index_rows.push((r, j, k32));
        }
        if ratio == 2 {
            let last = s + len - 1;
            if len > 0 && last % 2 == 0 {
                let row = t0 + len as usize - 1;
                let st = &mut state.kv_score[r * 2 * KV..(r + 1) * 2 * KV];
                st[..KV].copy_from_slice(&kv[row * KV..(row + 1) * KV]);
                st[KV..].copy_from_slice(&score.unwrap()[row * KV..(row + 1) * KV]);
                state.pos[r] = last as i32;
            } else if len > 0 {
                state.kv_score[r * 2 * KV..(r + 1) * 2 * KV].fill(0.0);
                state.pos[r] = -1;
            }
        }
    }
    out
}

// ---- indexer -------------------------------------------------------------------------------------

/// Indexer logits (T, n_cols) in f64 over the CPU-decoded index K.
#[allow(clippy::too_many_arguments)]
pub fn indexer_logits_ref(
    q: &[f32],
    w: &[f32],
    pos: &[i32],
    req: &[i32],
    block_table: &[i32],
    max_blocks: usize,
    index: &Pool,
    ratio: usize,
    cand_mask: Option<(&[u8], usize)>,
    n_cols: usize,
) -> Vec<f64> {
    use rayon::prelude::*;
    let t = pos.len();
    let mut out = vec![f64::NEG_INFINITY; t * n_cols];
    out.par_chunks_mut(n_cols).enumerate().for_each(|(row, o)| {
        let visible = (pos[row] as i64 + 1) / ratio as i64;
        let bt = &block_table[req[row] as usize * max_blocks..(req[row] as usize + 1) * max_blocks];
        for j in 0..n_cols.min(visible.max(0) as usize) {
            if let Some((m, s)) = cand_mask {
                if m[row * s + j / 8] == 0 {
                    continue;
                }
            }
            let Some(slot) = table_slot(bt, j as i64, index.layout.slots) else {
                continue;
            };
            let k: Vec<f64> = index.read_slot(slot).into_iter().map(f64::from).collect();
            let mut acc = 0.0f64;
            for h in 0..32 {
                let qh = &q[(row * 32 + h) * IDX..(row * 32 + h + 1) * IDX];
                let dot: f64 = qh.iter().zip(&k).map(|(&a, &b)| a as f64 * b).sum();
                acc += w[row * 32 + h] as f64 * dot.max(0.0);
            }
            o[j] = acc;
        }
    });
    out
}

/// Top-k reference with the kernel's contract (ascending indices, -1 padded).
pub fn topk_ref(keys: &[f32], n_cols: usize, n_valid: &[i32], k: usize) -> Vec<i32> {
    let mut out = vec![-1i32; n_valid.len() * k];
    for (t, &nv) in n_valid.iter().enumerate() {
        let n = (nv.max(0) as usize).min(n_cols);
        let row = &keys[t * n_cols..t * n_cols + n];
        let mut sel: Vec<usize> = if n <= k {
            (0..n).collect()
        } else {
            let mut cand: Vec<usize> = (0..n)
                .filter(|&i| !row[i].is_nan() && row[i] != f32::NEG_INFINITY)
                .collect();
            // Larger key first; ties → smaller index.
            cand.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
            cand.truncate(k);
            cand
        };
        sel.sort();
        for (i, &s) in sel.iter().enumerate() {
            out[t * k + i] = s as i32;
        }
    }
    out
}

/// Candidate-pool mask reference (T, ceil(n_cols / 8)).
pub fn candidate_mask_ref(logits: &[f32], n_cols: usize, n_valid: &[i32]) -> Vec<u8> {
    let nb = n_cols.div_ceil(8);
    let mut scores = vec![f32::NEG_INFINITY; n_valid.len() * nb];
    let mut nblk = vec![0i32; n_valid.len()];
    for (t, &nv) in n_valid.iter().enumerate() {
        let n = (nv.max(0) as usize).min(n_cols);
        nblk[t] = n.div_ceil(8) as i32;
        if n == 0 {
            continue;
        }
        let last = (n - 1) / 8;
        for b in 0..=last {
            scores[t * nb + b] = if b == last {
                f32::INFINITY
            } else {
                (0..8)
                    .map(|i| logits[t * n_cols + 8 * b + i])
                    .fold(f32::NEG_INFINITY, f32::max)
            };
        }
    }
    let kept = topk_ref(&scores, nb, &nblk, 2048);
    let mut mask = vec![0u8; n_valid.len() * nb];
    for t in 0..n_valid.len() {
        for &b in &kept[t * 2048..(t + 1) * 2048] {
            if b >= 0 {
                mask[t * nb + b as usize] = 1;
            }
        }
    }
    mask
}

// ---- attention -------------------------------------------------------------------------------------

/// Sparse decode attention reference: (out (T, 64, 512), lse (T, 64)) in f64.
#[allow(clippy::too_many_arguments)]
pub fn attention_ref(
    q: &[f32],
    topk: &[i32],
    topk_len: usize,
    pos: &[i32],
    req: &[i32],
    window_start: &[i32],
    main: &Pool,
    main_bt: &[i32],
    main_max_blocks: usize,
    swa: &Pool,
    swa_bt: &[i32],
    swa_max_blocks: usize,
    sink: Option<&[f32]>,
    inv_freq: Option<&[f64]>,
    scale: f32,
) -> (Vec<f64>, Vec<f64>) {
    use rayon::prelude::*;
    let t = pos.len();
    let mut out = vec![0.0f64; t * 64 * KV];
    let mut lse = vec![f64::NEG_INFINITY; t * 64];
    out.par_chunks_mut(64 * KV)
        .zip(lse.par_chunks_mut(64))
        .enumerate()
        .for_each(|(row, (out_row, lse_row))| {
            let r = req[row] as usize;
            let p = pos[row] as i64;
            let mbt = &main_bt[r * main_max_blocks..(r + 1) * main_max_blocks];
            let sbt = &swa_bt[r * swa_max_blocks..(r + 1) * swa_max_blocks];
            let mut keys: Vec<Vec<f32>> = vec![];
            for i in 0..topk_len {
                let j = topk[row * topk_len + i];
                if let Some(slot) = table_slot(mbt, j as i64, main.layout.slots) {
                    keys.push(main.read_slot(slot));
                }
            }
            let lo = (p - 127).max(0).max(window_start[row] as i64);
            for qp in lo..=p {
                if let Some(slot) = table_slot(sbt, qp, swa.layout.slots) {
                    keys.push(swa.read_slot(slot));
                }
            }
            for h in 0..64 {
                let qh = &q[(row * 64 + h) * KV..(row * 64 + h + 1) * KV];
                let o = &mut out_row[h * KV..(h + 1) * KV];
                if keys.is_empty() {
                    continue;
                }
                let z: Vec<f64> = keys
                    .iter()
                    .map(|k| {
                        scale as f64
                            * qh.iter()
                                .zip(k)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                    })
                    .collect();
                let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sk = sink.map_or(f64::NEG_INFINITY, |s| s[h] as f64);
                let mm = m.max(sk);
                let e: Vec<f64> = z.iter().map(|&v| (v - mm).exp()).collect();
                let l: f64 = e.iter().sum();
                let denom = l + (sk - mm).exp();
                for (k, &ek) in keys.iter().zip(&e) {
                    for (d, &kv) in k.iter().enumerate() {
                        o[d] += ek * kv as f64 / denom;
                    }
                }
                if let Some(f) = inv_freq {
                    rope(&mut o[448..], p, f, -1.0);
                }
                lse_row[h] = m + z.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
            }
        });
    (out, lse)
}

// ---- mHC ---------------------------------------------------------------------------------------------

pub struct MhcRefOut {
    pub x: Vec<f64>,
    pub pre: Vec<f64>,
    pub post: Vec<f64>,
    pub comb: Vec<f64>,
    pub x_in: Vec<f64>,
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn bf16r(v: f64) -> f64 {
    bf16_round(v as f32) as f64
}

/// One Mega-mHC boundary in f64 with the kernel's bf16 rounding points (X', u, x_in).
#[allow(clippy::too_many_arguments)]
pub fn mhc_ref(
    x: &[f32],
    y: Option<&[f32]>,
    post_prev: &[f32],
    comb_prev: &[f32],
    pre_carried: &[f32],
    fn_: &[f32],
    base: &[f32],
    scale: &[f32],
    norm_w: &[f32],
    d: usize,
) -> MhcRefOut {
    let t = pre_carried.len() / 4;
    let mut o = MhcRefOut {
        x: vec![0.0; t * 4 * d],
        pre: vec![0.0; t * 4],
        post: vec![0.0; t * 4],
        comb: vec![0.0; t * 16],
        x_in: vec![0.0; t * d],
    };
    for tk in 0..t {
        let xs = |i: usize, c: usize| x[(tk * 4 + i) * d + c] as f64;
        let mut xp = vec![0.0f64; 4 * d];
        for j in 0..4 {
            for c in 0..d {
                xp[j * d + c] = match y {
                    Some(y) => bf16r(
                        post_prev[tk * 4 + j] as f64 * y[tk * d + c] as f64
                            + (0..4)
                                .map(|i| comb_prev[tk * 16 + i * 4 + j] as f64 * xs(i, c))
                                .sum::<f64>(),
                    ),
                    None => xs(j, c),
                };
            }
        }
        o.x[tk * 4 * d..(tk + 1) * 4 * d].copy_from_slice(&xp);
        let r = 1.0 / (xp.iter().map(|v| v * v).sum::<f64>() / (4 * d) as f64 + EPS).sqrt();
        let mix: Vec<f64> = (0..24)
            .map(|m| {
                (0..4 * d)
                    .map(|k| fn_[m * 4 * d + k] as f64 * xp[k])
                    .sum::<f64>()
                    * r
            })
            .collect();
        for i in 0..4 {
            o.pre[tk * 4 + i] = sigmoid(mix[i] * scale[0] as f64 + base[i] as f64) + 1e-6;
            o.post[tk * 4 + i] = 2.0 * sigmoid(mix[4 + i] * scale[1] as f64 + base[4 + i] as f64);
        }
        let mut c = [[0.0f64; 4]; 4];
        for i in 0..4 {
            let row: Vec<f64> = (0..4)
                .map(|j| mix[8 + i * 4 + j] * scale[2] as f64 + base[8 + i * 4 + j] as f64)
                .collect();
            let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = row.iter().map(|v| (v - mx).exp()).sum();
            for j in 0..4 {
                c[i][j] = (row[j] - mx).exp() / s + 1e-6;
            }
        }
        for it in 0..20 {
            if it > 0 {
                for row in c.iter_mut() {
                    let s: f64 = row.iter().sum();
                    row.iter_mut().for_each(|v| *v /= s + 1e-6);
                }
            }
            for j in 0..4 {
                let s: f64 = (0..4).map(|i| c[i][j]).sum();
                (0..4).for_each(|i| c[i][j] /= s + 1e-6);
            }
        }
        for i in 0..4 {
            for j in 0..4 {
                o.comb[tk * 16 + i * 4 + j] = c[i][j];
            }
        }
        let u: Vec<f64> = (0..d)
            .map(|cc| {
                bf16r(
                    (0..4)
                        .map(|i| pre_carried[tk * 4 + i] as f64 * xp[i * d + cc])
                        .sum(),
                )
            })
            .collect();
        let ru = 1.0 / (u.iter().map(|v| v * v).sum::<f64>() / d as f64 + EPS).sqrt();
        for cc in 0..d {
            o.x_in[tk * d + cc] = bf16r(u[cc] * ru * norm_w[cc] as f64);
        }
    }
    o
}
