//! KV compressor of the Full layers (docs/SPEC.md §2.3).
//!
//! Groups never overlap: entry j covers tokens `[j·m, j·m + m)` and is emitted once token
//! `j·m + m − 1` has been seen (m = 2 on layers 2/8/14, m = 1 on layer 20). Per entry:
//! 1. pooled: m = 2 → per channel `w0 = softmax(score₀, score₁)[0]`,
//!    `pooled = w0·kv₀ + (1 − w0)·kv₁`; m = 1 → `pooled = kv`;
//! 2. `latent = bf16(RMSNorm(pooled, norm, eps))` (eps = 1e-20);
//! 3. main KV = RoPE(latent) on dims 448–511 at position j·m (the group's first token) → NVFP4-DS
//!    record (288 B);
//! 4. index K = RoPE(RMSNorm(wk · latent, k_norm, eps)) on dims 64–127 at j·m → MXFP4 record (68 B);
//!    the latent is taken *before* RoPE.
//!
//! A request's half-finished pair is carried in [`CompressorState`] across prefill chunks and decode
//! steps, so a pair split across two calls pools exactly as in one call.
//!
//! Shapes: `kv`, `score` (tokens, 512) f32; `norm` (512); `wk` (128, 512) row-major (output dim
//! first, the checkpoint's `[out, in]`); `k_norm` (128).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod reference;

use crate::error::{Error, Result};
use crate::formats::{INDEX_DIM, KV_DIM, MXFP4_INDEX_BYTES, NVFP4_DS_BYTES};
use crate::ops::rope::Rope;
use crate::shape::Dims;
use crate::tensor::{one_device, Device, TensorView, TensorViewMut};

/// The weights one Full layer applies to a pooled (compressed) entry: the entry's RMSNorm, then
/// the index-K projection and its RMSNorm. Borrowed views; the checkpoint's owned projections
/// that produce the pooled inputs (`wkv`, `wgate`) are `crate::weights::CompressorWeights`.
#[derive(Debug, Clone, Copy)]
pub struct PooledWeights<'a> {
    /// RMSNorm weight of the latent, (512).
    pub norm: &'a [f32],
    /// Index-K projection, (128, 512) row-major.
    pub wk: &'a [f32],
    /// RMSNorm weight of the index K, (128).
    pub k_norm: &'a [f32],
}

/// A configured compressor (one Full layer).
#[derive(Debug, Clone)]
pub struct Compressor<'a> {
    ratio: usize,
    eps: f64,
    rope: Rope,
    w: PooledWeights<'a>,
}

/// Per-request compressor state: the next position expected and the tokens of the open group.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompressorState {
    next_pos: u64,
    pending_kv: Vec<f32>,
    pending_score: Vec<f32>,
}

impl CompressorState {
    /// A state whose next token is at `start_pos` with no open group. `start_pos` must be a multiple
    /// of the ratio (checked by [`Compressor::compress`]).
    pub fn new(start_pos: u64) -> CompressorState {
        CompressorState {
            next_pos: start_pos,
            ..Default::default()
        }
    }
    /// Position of the next token this state expects.
    pub fn next_pos(&self) -> u64 {
        self.next_pos
    }
    /// Tokens of the open (not yet emitted) group.
    pub fn pending_tokens(&self) -> usize {
        self.pending_kv.len() / KV_DIM
    }
    /// The open group's carried rows: `kv` `(pending, 512)` and `score` `(pending, 512)` f32
    /// (`score` empty for ratio 1, which never carries a group).
    pub fn pending(&self) -> (&[f32], &[f32]) {
        (&self.pending_kv, &self.pending_score)
    }
    /// A state whose next token is at `next_pos`, carrying the open group's rows `kv` and `score`
    /// (each `(pending, 512)` f32, kv rows then score rows as [`CompressorState::pending`] gives
    /// them); the state a cache keeps per request between two calls (docs/SPEC.md §3 "compressor state").
    ///
    /// Errors: [`Error::Shape`] when `kv` and `score` differ in length or are not whole rows,
    /// [`Error::Invalid`] when more rows are carried than tokens precede `next_pos`, or for
    /// non-finite values.
    pub fn with_pending(next_pos: u64, kv: Vec<f32>, score: Vec<f32>) -> Result<CompressorState> {
        if !kv.len().is_multiple_of(KV_DIM) || score.len() != kv.len() {
            return Err(Error::shape(
                "carried compressor group",
                "kv and score of (pending, 512) each",
                format!("kv {} values, score {} values", kv.len(), score.len()),
            ));
        }
        let pending = kv.len() / KV_DIM;
        if pending as u64 > next_pos {
            return Err(Error::invalid(
                "next_pos",
                format!("{next_pos} is before the {pending} carried tokens"),
            ));
        }
        check_finite("carried kv", &kv, KV_DIM)?;
        check_finite("carried score", &score, KV_DIM)?;
        Ok(CompressorState {
            next_pos,
            pending_kv: kv,
            pending_score: score,
        })
    }
}

/// Entries emitted by one call, entry ids `first_entry .. first_entry + count`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Compressed {
    /// Id of the first entry (its group starts at token `first_entry · m`).
    pub first_entry: usize,
    /// Entries emitted.
    pub count: usize,
    /// (count, 512) f32, bf16-valued, before RoPE.
    pub latent: Vec<f32>,
    /// (count, 512) f32: RoPE(latent) at `j·m`, the values the NVFP4-DS record encodes.
    pub main_kv: Vec<f32>,
    /// (count, 288) NVFP4-DS records.
    pub main_kv_nvfp4: Vec<u8>,
    /// (count, 128) f32: the index K before quantisation.
    pub index_k: Vec<f32>,
    /// (count, 68) MXFP4 records.
    pub index_k_mxfp4: Vec<u8>,
}

impl<'a> Compressor<'a> {
    /// Builds a compressor of ratio `ratio` (1 or 2) with RMSNorm `eps` and the layer's `rope`.
    ///
    /// Errors: [`Error::Invalid`] for another ratio or a negative / non-finite eps, [`Error::Shape`]
    /// for weights of the wrong length.
    pub fn new(ratio: usize, eps: f64, rope: Rope, w: PooledWeights<'a>) -> Result<Self> {
        if !(ratio == 1 || ratio == 2) {
            return Err(Error::invalid(
                "ratio",
                format!("the compressor supports ratio 1 or 2, found {ratio}"),
            ));
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::invalid(
                "eps",
                format!("must be finite and ≥ 0, found {eps}"),
            ));
        }
        if rope.rope_dim() > INDEX_DIM {
            return Err(Error::invalid(
                "rope_dim",
                format!("must be ≤ {INDEX_DIM}, found {}", rope.rope_dim()),
            ));
        }
        for (name, v, want) in [
            ("compressor norm", w.norm.len(), KV_DIM),
            ("compressor wk", w.wk.len(), INDEX_DIM * KV_DIM),
            ("compressor k_norm", w.k_norm.len(), INDEX_DIM),
        ] {
            if v != want {
                return Err(Error::shape(
                    name,
                    format!("{want} values"),
                    format!("{v} values"),
                ));
            }
        }
        for (name, v) in [("norm", w.norm), ("wk", w.wk), ("k_norm", w.k_norm)] {
            check_finite(name, v, 1)?;
        }
        Ok(Compressor {
            ratio,
            eps,
            rope,
            w,
        })
    }

    /// Compression ratio m.
    pub fn ratio(&self) -> usize {
        self.ratio
    }
    /// RMSNorm epsilon.
    pub fn eps(&self) -> f64 {
        self.eps
    }
    /// The layer's RoPE.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }
    /// The layer's weights.
    pub fn weights(&self) -> &PooledWeights<'a> {
        &self.w
    }

    /// Feeds the next `T` tokens of a request (fast path): `kv` (T, 512) and, for ratio 2, `score`
    /// (T, 512). Returns the entries completed by these tokens and advances `state`.
    ///
    /// Errors: [`Error::Invalid`] when `score` is missing for ratio 2 (or given for ratio 1), when a
    /// fresh state does not start on a group boundary, or for non-finite inputs; [`Error::Shape`]
    /// for wrong lengths. The state is unchanged on error.
    pub fn compress(
        &self,
        state: &mut CompressorState,
        kv: &[f32],
        score: Option<&[f32]>,
    ) -> Result<Compressed> {
        let (first_entry, pooled) = self.pool(state, kv, score)?;
        Ok(cpu::finish(self, first_entry, pooled))
    }

    /// Checks the inputs, pools complete groups (f32) and advances the state.
    fn pool(
        &self,
        state: &mut CompressorState,
        kv: &[f32],
        score: Option<&[f32]>,
    ) -> Result<(usize, Vec<f32>)> {
        let m = self.ratio;
        if !kv.len().is_multiple_of(KV_DIM) {
            return Err(Error::shape(
                "compressor kv",
                "[T, 512]",
                format!("{} values", kv.len()),
            ));
        }
        let t = kv.len() / KV_DIM;
        check_gate(m, score.is_some())?;
        if let Some(s) = score.filter(|s| s.len() != kv.len()) {
            return Err(Error::shape(
                "compressor score",
                format!("[T={t}, 512]"),
                format!("{} values", s.len()),
            ));
        }
        let pending = state.pending_tokens();
        if !(state.next_pos as usize - pending).is_multiple_of(m) {
            return Err(Error::invalid(
                "start_pos",
                format!(
                    "a stateless call must start on a group boundary (a multiple of ratio {m}); position {} needs the carried half pair",
                    state.next_pos
                ),
            ));
        }
        // Positions are i64 everywhere else (RoPE, the indexer); the last token must be one.
        if state.next_pos.saturating_add(t as u64) > i64::MAX as u64 {
            return Err(Error::invalid(
                "start_pos",
                format!(
                    "tokens {} .. {} + {t} run past the largest position (2^63 − 1)",
                    state.next_pos, state.next_pos
                ),
            ));
        }
        check_finite("kv", kv, KV_DIM)?;
        if let Some(s) = score {
            check_finite("score", s, KV_DIM)?;
        }
        let first_pos = state.next_pos as usize - pending;
        let total = pending + t;
        let groups = total / m;
        let row = |i: usize, pk: &[f32], new: &[f32]| -> Vec<f32> {
            if i < pending {
                pk[i * KV_DIM..][..KV_DIM].to_vec()
            } else {
                new[(i - pending) * KV_DIM..][..KV_DIM].to_vec()
            }
        };
        let mut pooled = vec![0f32; groups * KV_DIM];
        for g in 0..groups {
            let dst = &mut pooled[g * KV_DIM..][..KV_DIM];
            if m == 1 {
                dst.copy_from_slice(&row(g, &state.pending_kv, kv));
            } else {
                let s = score.unwrap_or(&[]);
                let (k0, k1) = (
                    row(2 * g, &state.pending_kv, kv),
                    row(2 * g + 1, &state.pending_kv, kv),
                );
                let (s0, s1) = (
                    row(2 * g, &state.pending_score, s),
                    row(2 * g + 1, &state.pending_score, s),
                );
                cpu::gate_pool(&k0, &k1, &s0, &s1, dst);
            }
        }
        // Carry the open group's tokens.
        let rest = total - groups * m;
        let mut new_kv = Vec::with_capacity(rest * KV_DIM);
        let mut new_score = Vec::with_capacity(rest * KV_DIM);
        for i in groups * m..total {
            new_kv.extend(row(i, &state.pending_kv, kv));
            if let Some(s) = score {
                new_score.extend(row(i, &state.pending_score, s));
            }
        }
        state.pending_kv = new_kv;
        state.pending_score = new_score;
        state.next_pos += t as u64;
        Ok((first_pos / m, pooled))
    }
}

// ---- the batched, paged form (what the CUDA kernel runs; reference: `reference::compress_paged`) ----

/// One batched call's tokens, packed request after request, and the paged pools' addressing: the
/// compressor fused with the main-KV (NVFP4-DS) and index-K (MXFP4) cache writes. Entry j of request
/// r goes to slot [`block_table_slot`](crate::formats::page::block_table_slot)`(block_table[r], j,
/// page_slots)` of both pools (they share the block table).
#[derive(Debug, Clone, Copy)]
pub struct CompressorBatch<'a> {
    /// kv rows (tokens, 512) f32.
    pub kv: &'a [f32],
    /// Gate scores (tokens, 512) f32 — ratio 2 only.
    pub score: Option<&'a [f32]>,
    /// Token offsets (requests + 1,) i32: request r owns rows cu_tokens[r]..cu_tokens[r+1].
    pub cu_tokens: &'a [i32],
    /// Absolute position of each request's first row (requests,) i32.
    pub start_pos: &'a [i32],
    /// Compressed-cache block table (requests, max_blocks) i32; -1 = unmapped (entry skipped).
    pub block_table: &'a [i32],
    /// Columns of `block_table`.
    pub max_blocks: usize,
    /// Records per page in both pools.
    pub page_slots: usize,
}

/// The carried half-pair of ratio-2 compressors, one fixed-size row per request (the batched form
/// of [`CompressorState`]'s open group, laid out as the kernel keeps it on the device).
#[derive(Debug, Clone, PartialEq)]
pub struct CarryState {
    /// (requests, 1024) f32: the carried token's kv (512) then its score (512).
    pub kv_score: Vec<f32>,
    /// (requests,) i32: the carried token's position, -1 when nothing is carried.
    pub pos: Vec<i32>,
}

impl CarryState {
    /// Empty state for `requests` requests.
    pub fn new(requests: usize) -> CarryState {
        CarryState {
            kv_score: vec![0.0; requests * 2 * KV_DIM],
            pos: vec![-1; requests],
        }
    }
}

/// The checked geometry of one batched call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    /// Requests in the batch.
    pub requests: usize,
    /// Most entries any request completes in this call.
    pub max_entries: usize,
    /// Pages of the smaller of the two pools.
    pub pages: usize,
}

impl CompressorBatch<'_> {
    /// The batched call's signature: checks every length against the ratio, the carry and the two
    /// pools (`main_bytes`, `index_bytes`), and every block id against the pools.
    ///
    /// Errors: [`Error::Invalid`] / [`Error::Shape`] naming the argument (including a request that
    /// starts at an odd position without carrying the previous token).
    pub fn plan(
        &self,
        ratio: usize,
        state: Option<&CarryState>,
        main_bytes: usize,
        index_bytes: usize,
    ) -> Result<BatchPlan> {
        let len = |what: &str, found: usize, want: usize| -> Result<()> {
            if found != want {
                return Err(Error::shape(what, want, found));
            }
            Ok(())
        };
        if ratio != 1 && ratio != 2 {
            return Err(Error::invalid(
                "ratio",
                format!("{ratio} (the batched compressor supports 1 and 2)"),
            ));
        }
        if self.cu_tokens.is_empty() || self.cu_tokens[0] != 0 {
            return Err(Error::invalid("cu_tokens", "must start with 0"));
        }
        let requests = self.cu_tokens.len() - 1;
        len("start_pos", self.start_pos.len(), requests)?;
        len(
            "block_table",
            self.block_table.len(),
            requests * self.max_blocks,
        )?;
        if self.page_slots == 0 {
            return Err(Error::invalid("page_slots", "must be at least 1"));
        }
        if self.cu_tokens.windows(2).any(|p| p[1] < p[0]) {
            return Err(Error::invalid("cu_tokens", "must be non-decreasing"));
        }
        let tokens = *self.cu_tokens.last().unwrap_or(&0);
        len("kv values", self.kv.len(), tokens as usize * KV_DIM)?;
        match (ratio, self.score) {
            (2, Some(s)) => len("score values", s.len(), self.kv.len())?,
            (2, None) => return Err(Error::invalid("score", "ratio 2 needs gate scores")),
            _ => {}
        }
        if let Some(st) = state {
            len("state kv_score", st.kv_score.len(), requests * 2 * KV_DIM)?;
            len("state pos", st.pos.len(), requests)?;
        }
        let mut max_entries = 0usize;
        for r in 0..requests {
            let s = self.start_pos[r] as i64;
            let n = (self.cu_tokens[r + 1] - self.cu_tokens[r]) as i64;
            if s < 0 {
                return Err(Error::invalid(
                    "start_pos",
                    format!("request {r}: {s} is negative"),
                ));
            }
            let m = ratio as i64;
            max_entries = max_entries.max(((s + n) / m - s / m) as usize);
            if ratio == 2 && n > 0 && s % 2 == 1 {
                let st =
                    state.ok_or_else(|| Error::invalid("state", "ratio 2 needs a carry state"))?;
                if st.pos[r] != (s - 1) as i32 {
                    return Err(Error::invalid(
                        "state",
                        format!(
                            "request {r} starts at odd position {s} but carries position {} \
                             (expected {})",
                            st.pos[r],
                            s - 1
                        ),
                    ));
                }
            }
        }
        let main_page = self.page_slots * NVFP4_DS_BYTES;
        let index_page = self.page_slots * MXFP4_INDEX_BYTES;
        if !main_bytes.is_multiple_of(main_page) || !index_bytes.is_multiple_of(index_page) {
            return Err(Error::shape(
                "main / index page pools",
                format!("multiples of {main_page} / {index_page} bytes"),
                format!("{main_bytes} / {index_bytes}"),
            ));
        }
        let pages = (main_bytes / main_page).min(index_bytes / index_page);
        if let Some(&bad) = self
            .block_table
            .iter()
            .find(|&&x| x < -1 || x as i64 >= pages as i64)
        {
            return Err(Error::invalid(
                "block_table",
                format!("block {bad} is outside the {pages} pages of the pools"),
            ));
        }
        Ok(BatchPlan {
            requests,
            max_entries,
            pages,
        })
    }
}

// ---- the flat, stateless row form over tensor views (`csa2_compress`), dispatched by device ----

/// What one stateless compressor call computes, on either device: ratio (1 or 2), RMSNorm `eps`,
/// the layer's RoPE. The weights and rows are tensors ([`CompressViews`]); the CPU builds a
/// [`Compressor`] from these params, the CUDA branch checks them against what its kernel was
/// compiled for ([`cuda::kernel_supports`]).
#[derive(Debug, Clone)]
pub struct CompressorParams {
    /// Compression ratio m (1 or 2).
    pub ratio: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// The layer's RoPE.
    pub rope: Rope,
}

/// The input views of [`compress_view`] ([`signature::COMPRESS`]): `kv` `[T, 512]`, `score`
/// `[T, 512]` (ratio 2 only), `norm` `[512]`, `wk` `[128, 512]`, `k_norm` `[128]`, all float.
#[derive(Debug, Clone, Copy)]
pub struct CompressViews<'v, 'a> {
    /// `[T, 512]` projected KV of the tokens.
    pub kv: &'v TensorView<'a>,
    /// `[T, 512]` gate scores, ratio 2 only.
    pub score: Option<&'v TensorView<'a>>,
    /// `[512]` RMSNorm weight of the latent.
    pub norm: &'v TensorView<'a>,
    /// `[128, 512]` index-K projection.
    pub wk: &'v TensorView<'a>,
    /// `[128]` RMSNorm weight of the index K.
    pub k_norm: &'v TensorView<'a>,
}

/// Stateless compressor over tensor views (what `csa2_compress` runs): tokens `start_pos ..
/// start_pos + T` of `a.kv` become `E = T / ratio` entries, written as NVFP4-DS records to
/// `main_out` `[E, 288]` uint8 and MXFP4 records to `index_out` `[E, 68]` uint8 (entry i is the
/// group of tokens `start_pos + i·m ..`). `start_pos` and `T` must be multiples of the ratio.
///
/// Dispatched on the tensors' device: host memory runs [`Compressor::compress`]; CUDA memory
/// (feature `cuda`) runs `kernels/compressor.cu` in its row form ([`cuda::compress_rows`]) on
/// `stream` (a `CUstream` of the device's primary context; 0 = the legacy default stream;
/// ignored on the host), asynchronously: the call returns after the launch, without reading device
/// memory on the host. The CUDA branch reads float32 tensors only and, unlike the host, does not
/// scan the inputs for NaN / ±∞ (that would need a device → host read); positions must fit the
/// kernel's 32-bit int.
///
/// Errors: [`Error::Shape`] for a tensor off the signature or `E ≠ T / ratio`;
/// [`Error::Invalid`] for ratio ∉ {1, 2}, misaligned `start_pos` / `T`, `score` given or missing,
/// tensors on different devices, non-finite values (host); [`Error::NoCudaBuild`] for CUDA
/// tensors without the `cuda` feature; [`Error::Unsupported`] for a CUDA call the kernel was not
/// built for (eps, rope dims, a non-f32 tensor, a position past 2³¹ − 1); [`Error::Cuda`].
/// Nothing is written on error.
pub fn compress_view(
    p: &CompressorParams,
    a: &CompressViews<'_, '_>,
    start_pos: i64,
    stream: u64,
    main_out: &mut TensorViewMut<'_>,
    index_out: &mut TensorViewMut<'_>,
) -> Result<()> {
    use signature::{INDEX_K_OUT, KV, K_NORM, MAIN_KV_OUT, NORM, SCORE, WK};
    let mut dims = Dims::default();
    a.kv.expect(&KV, &mut dims)?;
    if let Some(s) = a.score {
        s.expect(&SCORE, &mut dims)?;
    }
    a.norm.expect(&NORM, &mut dims)?;
    a.wk.expect(&WK, &mut dims)?;
    a.k_norm.expect(&K_NORM, &mut dims)?;
    main_out.expect(&MAIN_KV_OUT, &mut dims)?;
    index_out.expect(&INDEX_K_OUT, &mut dims)?;
    let m = p.ratio;
    if !(m == 1 || m == 2) {
        return Err(Error::invalid(
            "ratio",
            format!("the compressor supports ratio 1 or 2, found {m}"),
        ));
    }
    check_gate(m, a.score.is_some())?;
    let t = a.kv.shape()[0];
    if start_pos < 0 || !(start_pos as u64).is_multiple_of(m as u64) || !t.is_multiple_of(m) {
        return Err(Error::invalid(
            "start_pos",
            format!(
                "start_pos and T must be multiples of the ratio {m} (stateless call), found \
                 start_pos {start_pos}, T {t}"
            ),
        ));
    }
    if main_out.shape()[0] != t / m {
        return Err(Error::shape(
            MAIN_KV_OUT.name,
            format!("[E={}, {NVFP4_DS_BYTES}] (T / ratio)", t / m),
            format!("{:?}", main_out.shape()),
        ));
    }
    let mut devices = vec![
        (KV.name, a.kv.device()),
        (NORM.name, a.norm.device()),
        (WK.name, a.wk.device()),
        (K_NORM.name, a.k_norm.device()),
        (MAIN_KV_OUT.name, main_out.device()),
        (INDEX_K_OUT.name, index_out.device()),
    ];
    if let Some(s) = a.score {
        devices.push((SCORE.name, s.device()));
    }
    match one_device(&devices)? {
        Device::Cpu => compress_host(p, a, start_pos, main_out, index_out),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::compress_rows(p, a, start_pos, stream, main_out, index_out),
        #[cfg(not(feature = "cuda"))]
        d @ Device::Cuda(_) => {
            let _ = stream;
            Err(crate::tensor::no_cuda_build(KV.name, d))
        }
    }
}

/// The host branch of [`compress_view`] (signature, alignment and device checked).
fn compress_host(
    p: &CompressorParams,
    a: &CompressViews<'_, '_>,
    start_pos: i64,
    main_out: &mut TensorViewMut<'_>,
    index_out: &mut TensorViewMut<'_>,
) -> Result<()> {
    use signature::{INDEX_K_OUT, KV, K_NORM, MAIN_KV_OUT, NORM, SCORE, WK};
    let (norm, wk, k_norm) = (
        a.norm.to_f32(NORM.name)?,
        a.wk.to_f32(WK.name)?,
        a.k_norm.to_f32(K_NORM.name)?,
    );
    let c = Compressor::new(
        p.ratio,
        p.eps,
        p.rope.clone(),
        PooledWeights {
            norm: &norm,
            wk: &wk,
            k_norm: &k_norm,
        },
    )?;
    let kv = a.kv.to_f32(KV.name)?;
    let score = a.score.map(|s| s.to_f32(SCORE.name)).transpose()?;
    let mut st = CompressorState::new(start_pos as u64);
    let out = c.compress(&mut st, &kv, score.as_deref())?;
    let e = main_out.shape()[0];
    if out.count != e || st.pending_tokens() != 0 {
        return Err(Error::Internal(format!(
            "compressor emitted {} entries ({} pending), expected {e}",
            out.count,
            st.pending_tokens()
        )));
    }
    main_out
        .as_mut_slice::<u8>(MAIN_KV_OUT.name)?
        .copy_from_slice(&out.main_kv_nvfp4);
    index_out
        .as_mut_slice::<u8>(INDEX_K_OUT.name)?
        .copy_from_slice(&out.index_k_mxfp4);
    Ok(())
}

fn check_finite(name: &str, v: &[f32], row: usize) -> Result<()> {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(Error::invalid(
            name,
            format!(
                "non-finite value {} at row {}, column {}",
                v[i],
                i / row,
                i % row
            ),
        ));
    }
    Ok(())
}

/// Records for `count` entries.
pub(crate) fn record_buffers(count: usize) -> (Vec<u8>, Vec<u8>) {
    (
        vec![0u8; count * NVFP4_DS_BYTES],
        vec![0u8; count * MXFP4_INDEX_BYTES],
    )
}

/// The tensor signature of the compressor exports (`csa2_compress`, `csa2_compress_step`) and
/// `csa2 op compress`'s inputs: E compressed entries come out of T tokens.
pub mod signature {
    use crate::formats::{INDEX_DIM, KV_DIM, MXFP4_INDEX_BYTES, NVFP4_DS_BYTES};
    use crate::shape::{Arg, Dim, Signature};
    use crate::tensor::{DType, FLOATS};

    /// `[T, 512]` float projected KV of the new tokens.
    pub const KV: Arg = Arg::read("kv", FLOATS, &[Dim::Any("T"), Dim::Fixed(KV_DIM)]);
    /// `[T, 512]` float gate scores (ratio 2 only).
    pub const SCORE: Arg =
        Arg::read("score", FLOATS, &[Dim::Any("T"), Dim::Fixed(KV_DIM)]).optional();
    /// `[512]` float RMSNorm weight of the latent.
    pub const NORM: Arg = Arg::read("norm", FLOATS, &[Dim::Fixed(KV_DIM)]);
    /// `[128, 512]` float index-K projection.
    pub const WK: Arg = Arg::read("wk", FLOATS, &[Dim::Fixed(INDEX_DIM), Dim::Fixed(KV_DIM)]);
    /// `[128]` float RMSNorm weight of the index K.
    pub const K_NORM: Arg = Arg::read("k_norm", FLOATS, &[Dim::Fixed(INDEX_DIM)]);
    /// `[E, 288]` uint8 NVFP4-DS main-KV records out.
    pub const MAIN_KV_OUT: Arg = Arg::write(
        "main_kv_out",
        &[DType::U8],
        &[Dim::Any("E"), Dim::Fixed(NVFP4_DS_BYTES)],
    );
    /// `[E, 68]` uint8 MXFP4 index-K records out.
    pub const INDEX_K_OUT: Arg = Arg::write(
        "index_k_out",
        &[DType::U8],
        &[Dim::Any("E"), Dim::Fixed(MXFP4_INDEX_BYTES)],
    );
    /// `csa2_compress` and `csa2_compress_step`.
    pub const COMPRESS: Signature = Signature {
        op: "compress",
        args: &[KV, SCORE, NORM, WK, K_NORM, MAIN_KV_OUT, INDEX_K_OUT],
    };
}

/// Ratio 2 compresses pairs through a softmax gate and needs its scores; ratio 1 has no gate. The
/// rule of docs/SPEC.md §2.3, checked the same way by the stateful and the stateless entries.
///
/// Errors: [`Error::Invalid`] (`score`) when the scores are missing for ratio 2 or given for ratio 1.
fn check_gate(ratio: usize, has_score: bool) -> Result<()> {
    match (ratio, has_score) {
        (2, false) => Err(Error::invalid(
            "score",
            "ratio 2 needs the gate scores (T, 512)",
        )),
        (1, true) => Err(Error::invalid(
            "score",
            "ratio 1 has no gate; pass no score",
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
