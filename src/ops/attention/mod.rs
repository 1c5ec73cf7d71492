//! Sparse + sliding-window attention with a sink (docs/SPEC.md §2.7–§2.8).
//!
//! For a query token at position p, head h (64 heads, MQA: K = V = the 512-d latent):
//! - attended set = the selected main-KV entries (top-k row, −1 masked, entries past the row's
//!   valid length ignored even if stale) ∪ the SWA window `[max(p − window + 1, 0, replay_start), p]`
//!   (row s of the SWA cache = token s);
//! - `z = (q_h · k) · scale` with scale = 512^-0.5; one softmax over the union, plus a per-head sink
//!   logit `a_h` that enters the denominator only:
//!   `o_h = Σ e^(z − M) k / (Σ e^(z − M) + e^(a_h − M))`, `M = max(max z, a_h)`;
//! - `lse_h = ln Σ e^z` over the attended set, *without* the sink (FlashMLA / FlashInfer
//!   convention); a row with nothing attended outputs zeros and `lse = −∞` (never NaN).
//!
//! The output is before the inverse RoPE on dims 448–511 ([`crate::ops::rope`], separate step).
//! Shapes: `q` (tokens, heads, 512) f32, main KV (N, 512) f32 or (N, 288) NVFP4-DS, SWA (S, 512) f32
//! or (S, 528) MXFP8, `topk` (tokens, K) i32, `sink` (heads) f32, `out` (tokens, heads, 512),
//! `lse` (tokens, heads).
//!
//! Two ways to name the attended rows, one kernel: [`attention`] resolves them from positions
//! (top-k ∪ the window, row s of the SWA cache = token s: one sequence), [`attention_indexed`]
//! takes them as explicit lists of main and SWA slots per token, as FlashMLA's sparse
//! `flash_mla_with_kvcache` receives them from vLLM's paged, batched caches. Both plan a
//! [`TokenRows`] per token and run the same fast path ([`cpu`]) and f64 reference ([`mod@reference`]).

mod bf16;
pub mod cpu;
mod crew;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decode_model;
mod int16;
pub mod pools;
pub mod reference;
pub mod split_plan;

pub use pools::{attention_pools, PoolDesc, PoolInputs, PoolLayout, PoolView};

use crate::error::{Error, Result};
use crate::formats::{RecordFormat, KV_DIM};
use crate::ops::visible;
use crate::shape::Dims;
use crate::tensor::{one_device, Device, TensorView, TensorViewMut};

/// Query heads of V4.1 (the geometry's, [`crate::geometry::consts`]).
pub use crate::geometry::consts::HEADS;

/// Most rows one token may attend (main + SWA, after −1 and length masking), in [`attention`]
/// and [`attention_indexed`]. The fast path decodes a token's rows into one f32 tile (about 2.3 KiB per row, kept
/// per thread), so an unbounded list would turn a few MiB of indices into an allocation that
/// aborts the process; FlashMLA's sparse lists are bounded too (top-k ≤ 2048 plus the SWA
/// window or vLLM's `prefill_index_width`). 65 536 rows leave room for any of them.
pub const MAX_TOKEN_ROWS: usize = 1 << 16;

/// Rows of a KV cache: f32 or one of the record formats (decoded exactly on use).
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    /// (rows, 512) f32.
    F32(&'a [f32]),
    /// (rows, record bytes) in the given 512-value format (NVFP4-DS, MXFP8, V4).
    Records(RecordFormat, &'a [u8]),
    /// A strided page pool read in place (vLLM's per-block slabs, [`pools`]): row `i` = slot `i`.
    Pool(PoolView<'a>),
}

impl KvRows<'_> {
    /// Number of rows.
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(x) => x.len() / KV_DIM,
            KvRows::Records(f, b) => b.len() / f.record_bytes(),
            KvRows::Pool(p) => p.desc().slots(),
        }
    }
    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Row `i` as f32.
    #[inline]
    pub fn row(&self, i: usize, out: &mut [f32]) {
        match self {
            KvRows::F32(x) => out.copy_from_slice(&x[i * KV_DIM..][..KV_DIM]),
            KvRows::Records(f, b) => {
                let rec = &b[i * f.record_bytes()..][..f.record_bytes()];
                let (d, s) = rec.split_at(f.data_bytes());
                f.decode_row(d, s, out);
            }
            KvRows::Pool(p) => {
                let (d, s) = p.parts(i);
                p.desc().format.decode_row(d, s, out);
            }
        }
    }
    fn check(&self, what: &str) -> Result<()> {
        match self {
            KvRows::F32(x) if x.len() % KV_DIM != 0 => Err(Error::shape(
                what,
                "[N, 512] f32",
                format!("{} values", x.len()),
            )),
            KvRows::Records(f, _) if f.dim() != KV_DIM => Err(Error::invalid(
                what,
                format!(
                    "format {} holds {} values per row, expected 512",
                    f.name(),
                    f.dim()
                ),
            )),
            KvRows::Records(f, b) if b.len() % f.record_bytes() != 0 => Err(Error::shape(
                what,
                format!("[N, {}] u8 ({})", f.record_bytes(), f.name()),
                format!("{} bytes", b.len()),
            )),
            KvRows::Pool(p) if p.desc().format.dim() != KV_DIM => Err(Error::invalid(
                what,
                format!(
                    "pool format {} holds {} values per state, expected 512",
                    p.desc().format.name(),
                    p.desc().format.dim()
                ),
            )),
            _ => Ok(()),
        }
    }
}

/// Attention parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    /// Query heads (64).
    pub heads: usize,
    /// SWA window in tokens (128).
    pub window: usize,
    /// Softmax scale (512^-0.5).
    pub scale: f32,
    /// When set, a selected index j must be visible (`j < (p + 1) div ratio`): a guard against stale
    /// or wrong top-k rows.
    pub ratio: Option<usize>,
}

impl Default for AttentionParams {
    fn default() -> Self {
        AttentionParams {
            heads: HEADS,
            window: 128,
            scale: (KV_DIM as f32).sqrt().recip(),
            ratio: None,
        }
    }
}

/// Operand precision of the fast path's two GEMMs (scores Q·Kᵀ and P·V).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionDots {
    /// f32 products and sums: reference-grade, within [`crate::tolerance::F32_VS_F64`].
    #[default]
    F32,
    /// bf16 products (`vdpbf16ps`, AVX-512 BF16) accumulated in f32, softmax in f32: K and V are
    /// exact in bf16 (NVFP4 / MXFP8 values), the scaled query and the softmax weights are rounded
    /// to bf16; within [`crate::tolerance::BF16_DOTS_VS_F64`].
    Bf16,
    /// [`AttentionDots::Bf16`] with the scores of NVFP4 main rows on int16 dots (`vpdpwssd`,
    /// AVX-512 VNNI): twice the E2M1 codes are integers, each 16-dim block's dot with the int16
    /// query is exact in int32 and scaled by the block's E4M3 scale in f32, one pass where the
    /// bf16 split needs two. Other rows (MXFP8 window, f32) and P·V as [`AttentionDots::Bf16`];
    /// within [`crate::tolerance::BF16_DOTS_VS_F64`].
    Int16,
}

impl AttentionDots {
    /// Whether this CPU runs `self` (f32: always; bf16: AVX-512 BF16 present and not capped off by
    /// `CSA2_ISA`, see [`crate::isa::dot_units`]).
    pub fn is_supported(self) -> bool {
        match self {
            AttentionDots::F32 => true,
            AttentionDots::Bf16 => crate::isa::dot_units().bf16 && bf16::supported(),
            AttentionDots::Int16 => {
                let u = crate::isa::dot_units();
                u.bf16 && u.vnni && int16::supported()
            }
        }
    }

    /// The backend's choice: [`AttentionDots::Int16`] where supported (AVX-512 VNNI and BF16,
    /// not capped off by `CSA2_ISA`), else [`AttentionDots::Bf16`] where supported, else f32;
    /// `CSA2_ATTENTION_DOTS=f32|bf16|int16` asks for one (read once; an unknown value is ignored,
    /// a path the CPU lacks falls back to the next one down). With the split query (hi + lo bf16
    /// halves, [`bf16`]) and the int16 query ([`int16`]) both meet
    /// [`crate::tolerance::BF16_DOTS_VS_F64`] in every attention test on rows exact in bf16,
    /// which every cache format decodes to; f32 stays the reference-grade option.
    pub fn backend_default() -> AttentionDots {
        static DOTS: std::sync::OnceLock<AttentionDots> = std::sync::OnceLock::new();
        *DOTS.get_or_init(|| {
            let asked = std::env::var("CSA2_ATTENTION_DOTS")
                .ok()
                .and_then(|v| AttentionDots::from_name(&v).ok());
            Self::choose(
                asked,
                AttentionDots::Bf16.is_supported(),
                AttentionDots::Int16.is_supported(),
            )
        })
    }

    /// [`AttentionDots::backend_default`]'s rule: what was asked for (`None`: nothing valid),
    /// int16 only where `int16_supported`, bf16 only where `bf16_supported`.
    fn choose(
        asked: Option<AttentionDots>,
        bf16_supported: bool,
        int16_supported: bool,
    ) -> AttentionDots {
        match asked {
            Some(AttentionDots::F32) => AttentionDots::F32,
            Some(AttentionDots::Int16) | None if int16_supported => AttentionDots::Int16,
            Some(_) | None if bf16_supported => AttentionDots::Bf16,
            _ => AttentionDots::F32,
        }
    }

    /// Whether `self` scores main rows of format `main` from their records in a way that their
    /// decoded f32 rows would not reproduce: [`AttentionDots::Int16`] on NVFP4-DS (the int16
    /// kernel reads the E2M1 codes and block scales; the same rows handed over as f32 take the
    /// bf16 split). A caller that may decode such rows up front (to share one decode among many
    /// tokens) must not, or a row's bits would depend on which rows share its call.
    pub fn reads_records(self, main: RecordFormat) -> bool {
        self == AttentionDots::Int16 && main == RecordFormat::Nvfp4Ds && self.is_supported()
    }

    /// Parses `f32`, `bf16` or `int16`.
    pub fn from_name(s: &str) -> Result<AttentionDots> {
        match s {
            "f32" => Ok(AttentionDots::F32),
            "bf16" => Ok(AttentionDots::Bf16),
            "int16" => Ok(AttentionDots::Int16),
            _ => Err(Error::invalid(
                "dots",
                format!("expected f32, bf16 or int16, found `{s}`"),
            )),
        }
    }
}

/// Per-token inputs.
#[derive(Debug, Clone, Copy)]
pub struct AttentionInputs<'a> {
    /// (tokens, heads, 512) f32, RoPE'd.
    pub q: &'a [f32],
    /// (tokens, K) i32 selected main-KV entries, −1 = none.
    pub topk: &'a [i32],
    /// Optional (tokens) valid length of each top-k row; entries at or after it are ignored.
    pub topk_len: Option<&'a [i32]>,
    /// (tokens) absolute positions.
    pub positions: &'a [i64],
    /// (tokens) window floor from bounded replay, or one value for all tokens; empty = 0.
    pub replay_start: &'a [i64],
    /// (heads) sink logits.
    pub sink: &'a [f32],
}

/// The rows one token attends: main-KV entry ids, then SWA row ids, all attended in this order by
/// one softmax (a repeated id is attended once per occurrence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRows {
    /// Selected main-KV entries (valid ones, in top-k order).
    pub main: Vec<usize>,
    /// SWA rows: the window `lo, lo + 1, …, p` for [`plan`], the valid listed slots for
    /// [`plan_indexed`].
    pub swa: Vec<usize>,
}

/// Per-token inputs of [`attention_indexed`]: the attended rows as explicit slot lists (FlashMLA's
/// sparse contract: `indices` / `topk_length` for the SWA cache, `extra_indices_in_kvcache` /
/// `extra_topk_length` for the compressed cache).
#[derive(Debug, Clone, Copy)]
pub struct IndexedInputs<'a> {
    /// (tokens, heads, 512) f32, RoPE'd; tokens = `q.len() / (heads · 512)`.
    pub q: &'a [f32],
    /// (heads) sink logits.
    pub sink: &'a [f32],
    /// (tokens, Km) i32 main-KV rows, −1 = none.
    pub main_idx: &'a [i32],
    /// Optional (tokens) valid length of each `main_idx` row, clamped to `[0, Km]`; slots at or
    /// after it are ignored (may hold anything).
    pub main_len: Option<&'a [i32]>,
    /// (tokens, Ks) i32 SWA rows, −1 = none.
    pub swa_idx: &'a [i32],
    /// Optional (tokens) valid length of each `swa_idx` row, clamped to `[0, Ks]`.
    pub swa_len: Option<&'a [i32]>,
}

/// Shapes of `q` (T, heads, 512) and `sink` (heads).
fn check_q_sink(h: usize, t: usize, q: &[f32], sink: &[f32]) -> Result<()> {
    if q.len() != t * h * KV_DIM {
        return Err(Error::shape(
            "attention q",
            format!("[T={t}, {h}, 512]"),
            format!("{} values", q.len()),
        ));
    }
    if sink.len() != h {
        return Err(Error::shape(
            "attention sink",
            format!("[{h}]"),
            format!("{} values", sink.len()),
        ));
    }
    Ok(())
}

/// No NaN or ±∞ in `q` or `sink` (they would poison every output of the token silently).
fn check_finite(h: usize, q: &[f32], sink: &[f32]) -> Result<()> {
    for (name, v, row) in [("q", q, h * KV_DIM), ("sink", sink, h)] {
        // A vectorisable scan (an OR of "exponent all ones" flags) first; the position only when
        // one is there.
        let any = v.chunks(256).any(|c| {
            c.iter().fold(0u32, |a, x| {
                a | u32::from(x.to_bits() & 0x7F80_0000 == 0x7F80_0000)
            }) != 0
        });
        if !any {
            continue;
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid(
                name,
                format!(
                    "non-finite value {} at token {}, element {}",
                    v[i],
                    i / row,
                    i % row
                ),
            ));
        }
    }
    Ok(())
}

/// Validates every input and resolves the attended rows of each token.
pub fn plan(
    p: &AttentionParams,
    inp: &AttentionInputs,
    main: &KvRows,
    swa: &KvRows,
) -> Result<Vec<TokenRows>> {
    main.check("main KV")?;
    swa.check("SWA KV")?;
    let t = inp.positions.len();
    let h = p.heads;
    if h == 0 || p.window == 0 {
        return Err(Error::invalid(
            "attention params",
            "heads and window must be > 0",
        ));
    }
    check_q_sink(h, t, inp.q, inp.sink)?;
    let k = inp.topk.len().checked_div(t).unwrap_or(0);
    if inp.topk.len() != t * k {
        return Err(Error::shape(
            "attention topk",
            format!("[T={t}, K]"),
            format!("{} values", inp.topk.len()),
        ));
    }
    if let Some(l) = inp.topk_len {
        if l.len() != t {
            return Err(Error::shape(
                "attention topk_len",
                format!("[T={t}]"),
                format!("{} values", l.len()),
            ));
        }
    }
    if !(inp.replay_start.len() <= 1 || inp.replay_start.len() == t) {
        return Err(Error::shape(
            "attention replay_start",
            format!("one value or [T={t}]"),
            format!("{} values", inp.replay_start.len()),
        ));
    }
    crate::ops::rope::check_positions(inp.positions)?;
    check_finite(h, inp.q, inp.sink)?;
    let (n, s) = (main.len(), swa.len());
    (0..t)
        .map(|i| {
            let pos = inp.positions[i] as usize;
            let valid = inp.topk_len.map_or(k, |l| (l[i].max(0) as usize).min(k));
            let vis = p.ratio.map(|m| visible(pos as i64, m.max(1)));
            let mut sel = Vec::with_capacity(valid);
            for (c, &j) in inp.topk[i * k..i * k + valid].iter().enumerate() {
                if j == -1 {
                    continue;
                }
                if j < -1 || j as usize >= n {
                    return Err(Error::invalid(
                        "topk",
                        format!("token {i}, slot {c}: entry {j} is outside the main KV (0..{n}, or −1)"),
                    ));
                }
                if let Some(v) = vis {
                    if j as usize >= v {
                        return Err(Error::invalid(
                            "topk",
                            format!("token {i} at position {pos}, slot {c}: entry {j} is not visible (only {v} entries)"),
                        ));
                    }
                }
                sel.push(j as usize);
            }
            let rs = match inp.replay_start.len() {
                0 => 0,
                1 => inp.replay_start[0],
                _ => inp.replay_start[i],
            }
            .max(0) as usize;
            let lo = (pos + 1).saturating_sub(p.window).max(rs);
            if lo <= pos && pos >= s {
                return Err(Error::shape(
                    "SWA KV",
                    format!("at least {} rows (token {i} at position {pos})", pos + 1),
                    format!("{s} rows"),
                ));
            }
            bounded(
                "topk / window",
                i,
                TokenRows {
                    main: sel,
                    swa: (lo..(pos + 1).max(lo)).collect(),
                },
            )
        })
        .collect()
}

/// `r` when token `i` attends at most [`MAX_TOKEN_ROWS`] rows, else an error naming `what`.
fn bounded(what: &str, i: usize, r: TokenRows) -> Result<TokenRows> {
    let rows = r.main.len() + r.swa.len();
    if rows > MAX_TOKEN_ROWS {
        return Err(Error::invalid(
            what,
            format!(
                "token {i} attends {rows} rows ({} main + {} SWA), more than \
                 MAX_TOKEN_ROWS = {MAX_TOKEN_ROWS}",
                r.main.len(),
                r.swa.len()
            ),
        ));
    }
    Ok(r)
}

/// Attention (fast path): writes `out` (tokens, heads, 512) and `lse` (tokens, heads).
///
/// Errors: [`Error::Shape`] for inconsistent shapes or an SWA cache shorter than a position,
/// [`Error::Invalid`] for an out-of-range or (with `ratio`) invisible top-k entry, or a token
/// attending more than [`MAX_TOKEN_ROWS`] rows.
pub fn attention(
    p: &AttentionParams,
    inp: &AttentionInputs,
    main: KvRows,
    swa: KvRows,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    attention_with_dots(p, AttentionDots::F32, inp, main, swa, out, lse)
}

/// [`attention`] with the GEMMs' operand precision chosen by `dots`.
///
/// Errors: those of [`attention`], and [`Error::Unsupported`] for [`AttentionDots::Bf16`] on a
/// CPU without AVX-512 BF16, or [`AttentionDots::Int16`] without AVX-512 VNNI and BF16 (or with
/// `CSA2_ISA` capping them off).
pub fn attention_with_dots(
    p: &AttentionParams,
    dots: AttentionDots,
    inp: &AttentionInputs,
    main: KvRows,
    swa: KvRows,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    if !dots.is_supported() {
        return Err(Error::Unsupported(format!(
            "attention dots {dots:?} need {}, which this CPU lacks or CSA2_ISA caps off",
            if dots == AttentionDots::Int16 {
                "AVX-512 VNNI and BF16"
            } else {
                "AVX-512 BF16"
            }
        )));
    }
    let rows = plan(p, inp, &main, &swa)?;
    let t = rows.len();
    check_out(p.heads, t, out, lse)?;
    cpu::attention(p, dots, inp.q, inp.sink, &rows, main, swa, out, lse);
    Ok(())
}

fn check_out(h: usize, t: usize, out: &[f32], lse: &[f32]) -> Result<()> {
    if out.len() != t * h * KV_DIM || lse.len() != t * h {
        return Err(Error::shape(
            "attention out / lse",
            format!("[{t}, {h}, 512] and [{t}, {h}]"),
            format!("{} and {} values", out.len(), lse.len()),
        ));
    }
    Ok(())
}

/// One token's valid slots of an index list: `ids[..len]` (len clamped to `[0, ids.len()]`, `None`
/// = all) without the −1 entries, each checked against the pool's `n` rows.
fn listed(what: &str, t: usize, ids: &[i32], len: Option<i32>, n: usize) -> Result<Vec<usize>> {
    let valid = len.map_or(ids.len(), |l| (l.max(0) as usize).min(ids.len()));
    let mut sel = Vec::with_capacity(valid);
    for (c, &j) in ids[..valid].iter().enumerate() {
        if j == -1 {
            continue;
        }
        if j < -1 || j as usize >= n {
            return Err(Error::invalid(
                what,
                format!("token {t}, slot {c}: row {j} is outside the pool (0..{n}, or −1)"),
            ));
        }
        sel.push(j as usize);
    }
    Ok(sel)
}

/// Shape of an index list `what` `(T, K)` and of its optional lengths `len_what` `(T)`; returns K.
fn check_list(
    (what, len_what): (&str, &str),
    t: usize,
    ids: &[i32],
    len: Option<&[i32]>,
) -> Result<usize> {
    let k = ids.len().checked_div(t).unwrap_or(0);
    if ids.len() != t * k {
        return Err(Error::shape(
            what,
            format!("[T={t}, K]"),
            format!("{} values", ids.len()),
        ));
    }
    if let Some(l) = len {
        if l.len() != t {
            return Err(Error::shape(
                len_what,
                format!("[T={t}]"),
                format!("{} values", l.len()),
            ));
        }
    }
    Ok(k)
}

/// Validates the inputs of [`attention_indexed`] and resolves each token's rows: the valid
/// `main_idx` slots, then the valid `swa_idx` slots, in list order. `p.window` and `p.ratio` are
/// not used (the caller already resolved the window and visibility).
///
/// Errors: [`Error::Shape`] for inconsistent shapes (tokens come from `q`), [`Error::Invalid`]
/// for a row id `< −1` or past its pool (naming the list, token, slot and id), a token attending
/// more than [`MAX_TOKEN_ROWS`] rows, non-finite `q` / `sink`, or `heads` = 0.
pub fn plan_indexed(
    p: &AttentionParams,
    inp: &IndexedInputs,
    main: &KvRows,
    swa: &KvRows,
) -> Result<Vec<TokenRows>> {
    main.check("main KV")?;
    swa.check("SWA KV")?;
    let h = p.heads;
    if h == 0 {
        return Err(Error::invalid("attention params", "heads must be > 0"));
    }
    let row = h
        .checked_mul(KV_DIM)
        .ok_or_else(|| Error::invalid("attention params", format!("{h} heads is too many")))?;
    let t = inp.q.len() / row;
    check_q_sink(h, t, inp.q, inp.sink)?;
    let km = check_list(("main_idx", "main_len"), t, inp.main_idx, inp.main_len)?;
    let ks = check_list(("swa_idx", "swa_len"), t, inp.swa_idx, inp.swa_len)?;
    check_finite(h, inp.q, inp.sink)?;
    let (n, s) = (main.len(), swa.len());
    (0..t)
        .map(|i| {
            let r = TokenRows {
                main: listed(
                    "main_idx",
                    i,
                    &inp.main_idx[i * km..][..km],
                    inp.main_len.map(|l| l[i]),
                    n,
                )?,
                swa: listed(
                    "swa_idx",
                    i,
                    &inp.swa_idx[i * ks..][..ks],
                    inp.swa_len.map(|l| l[i]),
                    s,
                )?,
            };
            bounded("main_idx / swa_idx", i, r)
        })
        .collect()
}

/// Attention over explicit slot lists (fast path; FlashMLA's sparse `flash_mla_with_kvcache`
/// contract as vLLM 0.33 `models/deepseek_v41/nvidia/flashmla.py` calls it): per token and head one
/// softmax over the rows of [`plan_indexed`] plus the sink in the denominator; writes `out`
/// (tokens, heads, 512) and `lse` (tokens, heads, without the sink; a token with nothing attended
/// gets zeros and −∞). Uses `p.heads` and `p.scale` only.
///
/// Errors: those of [`plan_indexed`], and [`Error::Shape`] for `out` / `lse`.
pub fn attention_indexed(
    p: &AttentionParams,
    inp: &IndexedInputs,
    main: KvRows,
    swa: KvRows,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let rows = plan_indexed(p, inp, &main, &swa)?;
    check_out(p.heads, rows.len(), out, lse)?;
    cpu::attention(
        p,
        AttentionDots::F32,
        inp.q,
        inp.sink,
        &rows,
        main,
        swa,
        out,
        lse,
    );
    Ok(())
}

/// A KV pool argument of [`attention_indexed_view`]: float rows `[N, 512]`, or uint8 records
/// `[N, record bytes]` of `format` (one record per row: data, then its own scales).
#[derive(Debug, Clone, Copy)]
pub struct KvView<'v, 'a> {
    /// The rows.
    pub rows: &'v TensorView<'a>,
    /// The records' format; `None` for float rows.
    pub format: Option<RecordFormat>,
}

/// The input views of [`attention_indexed_view`] ([`signature::ATTENTION_INDEXED`]).
#[derive(Debug, Clone, Copy)]
pub struct IndexedViews<'v, 'a> {
    /// `[T, H, 512]` float queries, RoPE'd.
    pub q: &'v TensorView<'a>,
    /// The compressed (main) KV pool, N rows.
    pub main: KvView<'v, 'a>,
    /// `[T, Km]` int32 rows of `main` per token (−1 skipped).
    pub main_idx: &'v TensorView<'a>,
    /// Optional `[T]` int32 valid length of each `main_idx` row.
    pub main_len: Option<&'v TensorView<'a>>,
    /// The SWA pool, S rows.
    pub swa: KvView<'v, 'a>,
    /// `[T, Ks]` int32 rows of `swa` per token (−1 skipped).
    pub swa_idx: &'v TensorView<'a>,
    /// Optional `[T]` int32 valid length of each `swa_idx` row.
    pub swa_len: Option<&'v TensorView<'a>>,
    /// `[H]` float attention sink per head.
    pub sink: &'v TensorView<'a>,
}

/// [`attention_indexed`] over tensor views (what `csa2_attention_indexed` runs), dispatched on
/// their device: host memory runs the fast path into `out` `[T, H, 512]` and `lse` `[T, H]`
/// (float), a non-finite result being an error ([`finite_output`]); CUDA memory (feature `cuda`)
/// runs `kernels/attention.cu`'s pool kernel ([`cuda::attention_indexed_rows`]) with each flat
/// pool as a pool of N pages of one record, on `stream` (the caller's `CUstream`, 0 = the legacy
/// default stream; ignored on the host), asynchronously and without reading device memory on the
/// host. Uses `p.heads` (must equal H) and `p.scale`.
///
/// The CUDA branch is the kernel's contract: bfloat16 `q` / `out`, float32 `sink` / `lse`, record
/// pools (NVFP4-DS, MXFP8, V4), H of 64 or 128, at most 65 535 tokens. Slots past a pool are
/// skipped there rather than reported (the host reads the lists, the GPU cannot without a
/// device → host copy), and the result is not scanned for NaN.
///
/// Errors: [`Error::Shape`] for a tensor off the signature; [`Error::Invalid`] for tensors on
/// different devices and those of [`plan_indexed`] (host); [`Error::NoCudaBuild`] for CUDA
/// tensors without the `cuda` feature; [`Error::Unsupported`] for a CUDA call outside the
/// kernel's contract; [`Error::Cuda`]. Nothing is written when a check fails.
pub fn attention_indexed_view(
    p: &AttentionParams,
    a: &IndexedViews<'_, '_>,
    stream: u64,
    out: &mut TensorViewMut<'_>,
    lse: &mut TensorViewMut<'_>,
) -> Result<()> {
    use signature as sig;
    let mut dims = Dims::default();
    a.q.expect(&sig::Q, &mut dims)?;
    a.sink.expect(&sig::SINK, &mut dims)?;
    out.expect(&sig::OUT, &mut dims)?;
    lse.expect(&sig::LSE, &mut dims)?;
    a.main_idx.expect(&sig::MAIN_IDX, &mut dims)?;
    a.swa_idx.expect(&sig::SWA_IDX, &mut dims)?;
    for (l, arg) in [(a.main_len, &sig::MAIN_LEN), (a.swa_len, &sig::SWA_LEN)] {
        if let Some(l) = l {
            l.expect(arg, &mut dims)?;
        }
    }
    for (kv, rows, records, width) in [
        (
            &a.main,
            &sig::MAIN_KV,
            &sig::MAIN_KV_RECORDS,
            "main_record_bytes",
        ),
        (
            &a.swa,
            &sig::SWA_KV,
            &sig::SWA_KV_RECORDS,
            "swa_record_bytes",
        ),
    ] {
        let mut d = Dims::default();
        match kv.format {
            Some(f) => {
                d.bind(width, f.record_bytes());
                kv.rows.expect(records, &mut d)?;
            }
            None => kv.rows.expect(rows, &mut d)?,
        }
    }
    if dims.get("H") != Some(p.heads) {
        return Err(Error::shape(
            "q",
            format!("[T, H={}, 512] (the params' heads)", p.heads),
            format!("{:?}", a.q.shape()),
        ));
    }
    let mut devices = vec![
        (sig::Q.name, a.q.device()),
        (sig::MAIN_KV.name, a.main.rows.device()),
        (sig::MAIN_IDX.name, a.main_idx.device()),
        (sig::SWA_KV.name, a.swa.rows.device()),
        (sig::SWA_IDX.name, a.swa_idx.device()),
        (sig::SINK.name, a.sink.device()),
        (sig::OUT.name, out.device()),
        (sig::LSE.name, lse.device()),
    ];
    if let Some(l) = a.main_len {
        devices.push((sig::MAIN_LEN.name, l.device()));
    }
    if let Some(l) = a.swa_len {
        devices.push((sig::SWA_LEN.name, l.device()));
    }
    match one_device(&devices)? {
        Device::Cpu => attention_indexed_host(p, a, out, lse),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::attention_indexed_rows(p, a, stream, out, lse),
        #[cfg(not(feature = "cuda"))]
        d @ Device::Cuda(_) => {
            let _ = stream;
            Err(crate::tensor::no_cuda_build(sig::Q.name, d))
        }
    }
}

/// The host branch of [`attention_indexed_view`] (signature and device checked).
fn attention_indexed_host(
    p: &AttentionParams,
    a: &IndexedViews<'_, '_>,
    out: &mut TensorViewMut<'_>,
    lse: &mut TensorViewMut<'_>,
) -> Result<()> {
    use signature as sig;
    let (q, sink) = (a.q.to_f32(sig::Q.name)?, a.sink.to_f32(sig::SINK.name)?);
    let (mf, sf) = (
        kv_floats(&a.main, sig::MAIN_KV.name)?,
        kv_floats(&a.swa, sig::SWA_KV.name)?,
    );
    let main = kv_rows(&a.main, &mf, sig::MAIN_KV.name)?;
    let swa = kv_rows(&a.swa, &sf, sig::SWA_KV.name)?;
    let inp = IndexedInputs {
        q: &q,
        sink: &sink,
        main_idx: a.main_idx.as_slice::<i32>(sig::MAIN_IDX.name)?,
        main_len: a
            .main_len
            .map(|l| l.as_slice::<i32>(sig::MAIN_LEN.name))
            .transpose()?,
        swa_idx: a.swa_idx.as_slice::<i32>(sig::SWA_IDX.name)?,
        swa_len: a
            .swa_len
            .map(|l| l.as_slice::<i32>(sig::SWA_LEN.name))
            .transpose()?,
    };
    let mut o = vec![0f32; out.numel()];
    let mut l = vec![0f32; lse.numel()];
    attention_indexed(p, &inp, main, swa, &mut o, &mut l)?;
    finite_output(&o, &l, p.heads)?;
    out.write_f32s(sig::OUT.name, &o)?;
    lse.write_f32s(sig::LSE.name, &l)
}

/// Float rows of a pool view as f32 (empty for records).
fn kv_floats<'a>(kv: &KvView<'_, 'a>, what: &str) -> Result<std::borrow::Cow<'a, [f32]>> {
    match kv.format {
        Some(_) => Ok(std::borrow::Cow::Borrowed(&[][..])),
        None => kv.rows.to_f32(what),
    }
}

/// The [`KvRows`] of a pool view: its records in place, or `floats` ([`kv_floats`]).
fn kv_rows<'b>(kv: &KvView<'_, 'b>, floats: &'b [f32], what: &str) -> Result<KvRows<'b>> {
    Ok(match kv.format {
        Some(f) => KvRows::Records(f, kv.rows.as_slice::<u8>(what)?),
        None => KvRows::F32(floats),
    })
}

/// No silent NaN: the inputs are checked before the op, but a KV record can still decode to
/// NaN/Inf (E4M3 0x7F, UE8M0 0xFF, an f32 pool holding NaN) or a legal extreme scale can overflow
/// f32, and FlashMLA would return the NaN. `out` is `(T, H, 512)`, `lse` `(T, H)`; −∞ in `lse` is a
/// token with nothing attended and is fine.
///
/// Errors: [`Error::Invalid`] naming the first token and head with a non-finite result.
pub fn finite_output(out: &[f32], lse: &[f32], heads: usize) -> Result<()> {
    let bad = out.iter().position(|v| !v.is_finite()).map(|i| i / KV_DIM);
    let bad = bad.or_else(|| lse.iter().position(|v| v.is_nan() || *v == f32::INFINITY));
    match bad {
        None => Ok(()),
        Some(row) => Err(Error::invalid(
            "attention output",
            format!(
                "non-finite result at token {}, head {}: the KV rows it attends decode to \
                 NaN/Inf, or the scale overflows f32",
                row / heads.max(1),
                row % heads.max(1)
            ),
        )),
    }
}

/// Runs the fast path on rows already planned by [`plan_indexed`] (or [`plan`]); shapes were
/// checked there. For entries that build their own [`KvRows`] (e.g. [`pools::attention_pools`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_with_rows(
    p: &AttentionParams,
    dots: AttentionDots,
    q: &[f32],
    sink: &[f32],
    rows: &[TokenRows],
    main: KvRows,
    swa: KvRows,
    out: &mut [f32],
    lse: &mut [f32],
) {
    cpu::attention(p, dots, q, sink, rows, main, swa, out, lse);
}

/// The tensor signatures of the attention exports (`csa2_attention`, `csa2_attention_indexed`,
/// `csa2_attention_pools`) and `csa2 op attention`. A KV argument has two forms, float rows or
/// uint8 records of the format the call names; the record width is bound from that format
/// (`main_record_bytes`, `swa_record_bytes`) before the check.
pub mod signature {
    use crate::formats::KV_DIM;
    use crate::shape::{Arg, Dim, Signature};
    use crate::tensor::{DType, FLOATS, INTS};

    /// `[T, H, 512]` float queries, RoPE'd.
    pub const Q: Arg = Arg::read(
        "q",
        FLOATS,
        &[Dim::Any("T"), Dim::Any("H"), Dim::Fixed(KV_DIM)],
    );
    /// `[H]` float attention sink per head.
    pub const SINK: Arg = Arg::read("sink", FLOATS, &[Dim::Any("H")]);
    /// `[T, H, 512]` float output (before the inverse RoPE).
    pub const OUT: Arg = Arg::write(
        "out",
        FLOATS,
        &[Dim::Any("T"), Dim::Any("H"), Dim::Fixed(KV_DIM)],
    );
    /// `[T, H]` float log-sum-exp without the sink (−∞: nothing attended).
    pub const LSE: Arg = Arg::write("lse", FLOATS, &[Dim::Any("T"), Dim::Any("H")]);
    /// `[T, K]` int32 selected main-KV entries (−1 = none).
    pub const TOPK: Arg = Arg::read("topk", &[DType::I32], &[Dim::Any("T"), Dim::Any("K")]);
    /// `[T]` int32 valid length of each `topk` row.
    pub const TOPK_LEN: Arg = Arg::read("topk_len", &[DType::I32], &[Dim::Any("T")]).optional();
    /// `[T]` int token positions.
    pub const POSITIONS: Arg = Arg::read("positions", INTS, &[Dim::Any("T")]);
    /// `[T]` int SWA window floor per token.
    pub const REPLAY_START: Arg = Arg::read("replay_start", INTS, &[Dim::Any("T")]).optional();
    /// `[1]` int SWA window floor of every token: the other form of [`REPLAY_START`].
    pub const REPLAY_START_ALL: Arg = Arg::read("replay_start", INTS, &[Dim::Fixed(1)]).optional();
    /// `[N, 512]` float main-KV rows.
    pub const MAIN_KV: Arg = Arg::read("main_kv", FLOATS, &[Dim::Any("N"), Dim::Fixed(KV_DIM)]);
    /// `[N, main_record_bytes]` uint8 main-KV records: the other form of [`MAIN_KV`].
    pub const MAIN_KV_RECORDS: Arg = Arg::read(
        "main_kv",
        &[DType::U8],
        &[Dim::Any("N"), Dim::Any("main_record_bytes")],
    );
    /// `[S, 512]` float SWA rows, row s = token s.
    pub const SWA: Arg = Arg::read("swa", FLOATS, &[Dim::Any("S"), Dim::Fixed(KV_DIM)]);
    /// `[S, swa_record_bytes]` uint8 SWA records: the other form of [`SWA`].
    pub const SWA_RECORDS: Arg = Arg::read(
        "swa",
        &[DType::U8],
        &[Dim::Any("S"), Dim::Any("swa_record_bytes")],
    );
    /// `csa2_attention`.
    pub const ATTENTION: Signature = Signature {
        op: "attention",
        args: &[
            Q,
            MAIN_KV,
            MAIN_KV_RECORDS,
            SWA,
            SWA_RECORDS,
            TOPK,
            TOPK_LEN,
            POSITIONS,
            REPLAY_START,
            REPLAY_START_ALL,
            SINK,
            OUT,
            LSE,
        ],
    };

    /// `[T, Km]` int32 rows of `main_kv` per token (−1 skipped).
    pub const MAIN_IDX: Arg =
        Arg::read("main_idx", &[DType::I32], &[Dim::Any("T"), Dim::Any("Km")]);
    /// `[T]` int32 valid length of each `main_idx` row.
    pub const MAIN_LEN: Arg = Arg::read("main_len", &[DType::I32], &[Dim::Any("T")]).optional();
    /// `[S, 512]` float SWA pool (rows named by `swa_idx`).
    pub const SWA_KV: Arg = Arg::read("swa_kv", FLOATS, &[Dim::Any("S"), Dim::Fixed(KV_DIM)]);
    /// `[S, swa_record_bytes]` uint8 SWA pool records: the other form of [`SWA_KV`].
    pub const SWA_KV_RECORDS: Arg = Arg::read(
        "swa_kv",
        &[DType::U8],
        &[Dim::Any("S"), Dim::Any("swa_record_bytes")],
    );
    /// `[T, Ks]` int32 rows of `swa_kv` per token (−1 skipped).
    pub const SWA_IDX: Arg = Arg::read("swa_idx", &[DType::I32], &[Dim::Any("T"), Dim::Any("Ks")]);
    /// `[T]` int32 valid length of each `swa_idx` row.
    pub const SWA_LEN: Arg = Arg::read("swa_len", &[DType::I32], &[Dim::Any("T")]).optional();
    /// `csa2_attention_indexed`.
    pub const ATTENTION_INDEXED: Signature = Signature {
        op: "attention_indexed",
        args: &[
            Q,
            MAIN_KV,
            MAIN_KV_RECORDS,
            MAIN_IDX,
            MAIN_LEN,
            SWA_KV,
            SWA_KV_RECORDS,
            SWA_IDX,
            SWA_LEN,
            SINK,
            OUT,
            LSE,
        ],
    };

    /// `csa2_attention_pools` ([`super::pools`]): bfloat16 queries padded to Hp ∈ {64, 128} heads
    /// of which h (bound from the call's `heads`) are real; the pools are strided views described
    /// by their own descriptors, not by a shape.
    pub mod pools {
        pub use super::{MAIN_IDX, MAIN_LEN, SWA_IDX, SWA_LEN};
        use crate::formats::KV_DIM;
        use crate::shape::{Arg, Dim, Signature};
        use crate::tensor::DType;

        /// `[T, Hp, 512]` bfloat16 queries.
        pub const Q: Arg = Arg::read(
            "q",
            &[DType::Bf16],
            &[Dim::Any("T"), Dim::Any("Hp"), Dim::Fixed(KV_DIM)],
        );
        /// `[T, Hp, 512]` bfloat16 output.
        pub const OUT: Arg = Arg::write(
            "out",
            &[DType::Bf16],
            &[Dim::Any("T"), Dim::Any("Hp"), Dim::Fixed(KV_DIM)],
        );
        /// `[h]` float32 sink of the real heads.
        pub const SINK: Arg = Arg::read("sink", &[DType::F32], &[Dim::Any("h")]);
        /// `[T, h]` float32 log-sum-exp of the real heads.
        pub const LSE: Arg =
            Arg::write("lse", &[DType::F32], &[Dim::Any("T"), Dim::Any("h")]).optional();
        /// `[4]` int32 first bad slot (list, token, slot, id), written by the CUDA kernel.
        pub const ERROR: Arg = Arg::write("error", &[DType::I32], &[Dim::Fixed(4)]).optional();
        /// `csa2_attention_pools` (tensor arguments other than the pools).
        pub const ATTENTION_POOLS: Signature = Signature {
            op: "attention_pools",
            args: &[
                Q, MAIN_IDX, MAIN_LEN, SWA_IDX, SWA_LEN, SINK, OUT, LSE, ERROR,
            ],
        };
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod view_tests;
