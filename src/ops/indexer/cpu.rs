//! Indexer fast path.
//!
//! The index Q of a token is stored transposed, `qt[d][h]` (heads padded to [`HPAD`] with zero
//! weight), so that one vector holds the same dim of L heads. Keys are decoded [`KB`] at a time
//! into plain f32 rows with the SIMD row codec (bit-identical to the reference decode), and the
//! kernel broadcasts `k[d]` against the head vectors: [`NK`] keys × 2 head vectors = 12 independent
//! FMA chains, no transposition of the keys and one horizontal sum per key. ReLU and the head
//! weights are applied lane-wise before that sum. A decoded batch is reused by every query of a
//! query block (prefill); decode (one query) splits the keys across threads instead.
//!
//! Every query quantisation (`none`, `mxfp4`, `fp8`, `bf16`) can run this f32 path on the exact
//! (de)quantised values: the results agree with the f64 reference within the tolerance table.
//! Where the CPU has them (see [`crate::isa::dot_units`]), MXFP4 queries against MXFP4 keys
//! run the integer kernel and bf16 queries against MXFP4 keys the bf16 kernel ([`super::dot`]);
//! [`DotKernel`] names the three, and [`Prepared::with_kernel`] picks one explicitly.

use super::dot::{self, Bf16Queries, IntKeys, IntQueries};
use super::{IndexKeys, IndexerParams, IndexerQueries, QueryQuant, INDEX_DIM};
use crate::error::{Error, Result};
use crate::formats::{fast, RecordFormat, MXFP4_INDEX_BYTES};
use crate::isa::{dot_units, level};
use crate::ops::simd::{multiversion, Vf32};
use rayon::prelude::*;

/// Heads are padded to a multiple of this: two 16-lane vectors (or four 8-lane ones).
const HPAD: usize = 32;
/// Queries sharing one decoded key batch in prefill.
const QB: usize = 8;
/// Keys decoded per batch (15 KiB of f32 rows: stays in L1 beside one query's 16 KiB `qt`).
const KB: usize = 30;
/// Keys scored together by the kernel: 6 keys × 2 head vectors = 12 accumulators, enough to
/// cover the FMA latency of two ports, and 15 registers in all (fits AVX2's 16).
const NK: usize = 6;
/// Keys per task when one query's keys are split across threads.
const KEYS_PER_TASK: usize = 8192;

/// The dot kernel that scores MXFP4 keys (f32 keys always use [`DotKernel::F32`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DotKernel {
    /// f32 FMAs on the decoded values (any CPU, any query quantisation): reference-grade.
    F32,
    /// Exact int8 block dots (`vpdpbusd`, AVX-512 VNNI); needs query quantisation `mxfp4`.
    Int8,
    /// bf16 products accumulated in f32 (`vdpbf16ps`, AVX-512 BF16); needs query quantisation
    /// `bf16`.
    Bf16,
}

impl DotKernel {
    /// Name used in benchmark output.
    pub fn name(self) -> &'static str {
        match self {
            DotKernel::F32 => "f32",
            DotKernel::Int8 => "int8 (vpdpbusd)",
            DotKernel::Bf16 => "bf16 (vdpbf16ps)",
        }
    }
}

/// Queries after fake quantisation, transposed and padded.
pub struct Prepared {
    /// (tokens, 128, hp): `qt[(t · 128 + d) · hp + h]`.
    qt: Vec<f32>,
    /// (tokens, hp).
    w: Vec<f32>,
    hp: usize,
    vis: Vec<usize>,
    kernel: DotKernel,
    /// The MXFP4 codes of the queries (integer kernel only).
    iq: Option<IntQueries>,
    /// The bf16 queries (bf16 kernel only).
    bq: Option<Bf16Queries>,
}

impl Prepared {
    /// Copies, fake-quantises, transposes and pads the queries; `vis` = visible entries per token.
    pub fn new(p: &IndexerParams, qs: &IndexerQueries, vis: Vec<usize>) -> Prepared {
        let t = vis.len();
        let hp = p.heads.div_ceil(HPAD) * HPAD;
        let mut qt = vec![0f32; t * INDEX_DIM * hp];
        let mut w = vec![0f32; t * hp];
        let mut row = [0f32; INDEX_DIM];
        for ti in 0..t {
            let dst = &mut qt[ti * INDEX_DIM * hp..][..INDEX_DIM * hp];
            for h in 0..p.heads {
                row.copy_from_slice(&qs.q[(ti * p.heads + h) * INDEX_DIM..][..INDEX_DIM]);
                p.query_quant.apply(&mut row);
                for (d, &v) in row.iter().enumerate() {
                    dst[d * hp + h] = v;
                }
                w[ti * hp + h] = qs.w[ti * p.heads + h];
            }
        }
        let units = dot_units();
        let kernel = match p.query_quant {
            QueryQuant::Mxfp4 if units.vnni => DotKernel::Int8,
            QueryQuant::Bf16 if units.bf16 => DotKernel::Bf16,
            _ => DotKernel::F32,
        };
        let mut pr = Prepared {
            qt,
            w,
            hp,
            vis,
            kernel: DotKernel::F32,
            iq: None,
            bq: None,
        };
        pr.set_kernel(kernel, qs, p.heads);
        pr
    }

    /// The same queries scored by `kernel` (tests and A/B benchmarks; [`Prepared::new`] picks
    /// the fastest the CPU and the query quantisation allow).
    ///
    /// Errors: [`Error::Unsupported`] when this CPU lacks the kernel's instructions,
    /// [`Error::Invalid`] when the query quantisation does not match it (`int8` needs `mxfp4`,
    /// `bf16` needs `bf16`).
    pub fn with_kernel(
        p: &IndexerParams,
        qs: &IndexerQueries,
        vis: Vec<usize>,
        kernel: DotKernel,
    ) -> Result<Prepared> {
        let (needs, have) = match kernel {
            DotKernel::F32 => (p.query_quant, true),
            DotKernel::Int8 => (QueryQuant::Mxfp4, dot::int8_supported()),
            DotKernel::Bf16 => (QueryQuant::Bf16, dot::bf16_supported()),
        };
        if !have {
            return Err(Error::Unsupported(format!(
                "indexer kernel {} needs instructions this CPU lacks",
                kernel.name()
            )));
        }
        if needs != p.query_quant {
            return Err(Error::invalid(
                "kernel",
                format!(
                    "indexer kernel {} needs query quantisation {needs:?}, found {:?}",
                    kernel.name(),
                    p.query_quant
                ),
            ));
        }
        let mut pr = Prepared::new(p, qs, vis);
        pr.set_kernel(kernel, qs, p.heads);
        Ok(pr)
    }

    fn set_kernel(&mut self, kernel: DotKernel, qs: &IndexerQueries, heads: usize) {
        let t = self.tokens();
        self.kernel = kernel;
        self.iq = (kernel == DotKernel::Int8).then(|| IntQueries::new(qs.q, t, heads, self.hp));
        self.bq = (kernel == DotKernel::Bf16).then(|| Bf16Queries::new(&self.qt, t, self.hp));
    }

    /// The kernel that scores MXFP4 keys.
    pub fn kernel(&self) -> DotKernel {
        self.kernel
    }
    fn tokens(&self) -> usize {
        self.vis.len()
    }
}

/// Dense logits; `out` is (tokens, keys.len()).
pub fn dense(pr: &Prepared, keys: IndexKeys, out: &mut [f32]) {
    let t = pr.tokens();
    let n = keys.len();
    if t == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    if t >= threads * QB {
        // Prefill: query blocks in parallel, each decoding a tile once for all its queries.
        out.par_chunks_mut(QB * n)
            .enumerate()
            .for_each(|(bi, rows)| {
                let t0 = bi * QB;
                let nq = rows.len() / n;
                let max_vis = pr.vis[t0..t0 + nq].iter().copied().max().unwrap_or(0);
                let mut ids = Vec::with_capacity(KEYS_PER_TASK);
                let mut start = 0;
                while start < max_vis {
                    let end = (start + KEYS_PER_TASK).min(max_vis);
                    ids.clear();
                    ids.extend(start as u32..end as u32);
                    let mut outs: Vec<&mut [f32]> =
                        rows.chunks_mut(n).map(|r| &mut r[start..end]).collect();
                    score_ids(pr, t0, &keys, &ids, &mut outs);
                    start = end;
                }
                for r in rows.chunks_mut(n) {
                    r[max_vis..].fill(f32::NEG_INFINITY);
                }
            });
    } else {
        // Decode / short batches: split each query's keys across threads.
        for (ti, row) in out.chunks_mut(n).enumerate() {
            let v = pr.vis[ti];
            row[v..].fill(f32::NEG_INFINITY);
            row[..v]
                .par_chunks_mut(KEYS_PER_TASK)
                .enumerate()
                .for_each(|(c, part)| {
                    let s = c * KEYS_PER_TASK;
                    let ids: Vec<u32> = (s as u32..(s + part.len()) as u32).collect();
                    score_ids(pr, ti, &keys, &ids, &mut [part]);
                });
        }
    }
}

/// Logits only at `pools[t]` (sorted entry ids); −∞ elsewhere. `out` is (tokens, keys.len()).
pub fn pooled(pr: &Prepared, keys: IndexKeys, pools: &[Vec<u32>], out: &mut [f32]) {
    let n = keys.len();
    if pr.tokens() == 0 || n == 0 {
        return;
    }
    out.par_chunks_mut(n).enumerate().for_each(|(ti, row)| {
        let ids = &pools[ti];
        let mut vals = vec![0f32; ids.len()];
        if pr.tokens() == 1 {
            vals.par_chunks_mut(KEYS_PER_TASK)
                .zip(ids.par_chunks(KEYS_PER_TASK))
                .for_each(|(v, id)| score_ids(pr, ti, &keys, id, &mut [v]));
        } else {
            score_ids(pr, ti, &keys, ids, &mut [&mut vals[..]]);
        }
        row.fill(f32::NEG_INFINITY);
        for (&j, &v) in ids.iter().zip(&vals) {
            row[j as usize] = v;
        }
    });
}

/// Scores entries `ids` (ascending) for queries `t0 .. t0 + outs.len()`; `outs[i][k]` receives the
/// logit of `ids[k]` for query `t0 + i` (−∞ when `ids[k]` is not visible to it).
pub fn score_ids(pr: &Prepared, t0: usize, keys: &IndexKeys, ids: &[u32], outs: &mut [&mut [f32]]) {
    match (pr.kernel, keys) {
        (DotKernel::Int8, IndexKeys::Mxfp4(k)) => return score_ids_int(pr, t0, k, ids, outs),
        (DotKernel::Bf16, IndexKeys::Mxfp4(k)) => return score_ids_bf16(pr, t0, k, ids, outs),
        _ => {}
    }
    let isa = level();
    let mut kbuf = [[0f32; INDEX_DIM]; KB];
    let mut next = ids.chunks(KB).skip(1);
    for (ci, chunk) in ids.chunks(KB).enumerate() {
        if let (Some(n), IndexKeys::Mxfp4(k)) = (next.next(), keys) {
            prefetch_records(k, n);
        }
        let off = ci * KB;
        let first = chunk[0] as usize;
        if (0..outs.len()).all(|qi| first >= pr.vis[t0 + qi]) {
            for out in outs.iter_mut() {
                out[off..off + chunk.len()].fill(f32::NEG_INFINITY);
            }
            continue;
        }
        let kb = key_rows(isa, keys, chunk, &mut kbuf);
        for (qi, out) in outs.iter_mut().enumerate() {
            let t = t0 + qi;
            let dst = &mut out[off..off + chunk.len()];
            if first >= pr.vis[t] {
                dst.fill(f32::NEG_INFINITY);
                continue;
            }
            let qt = &pr.qt[t * INDEX_DIM * pr.hp..][..INDEX_DIM * pr.hp];
            let w = &pr.w[t * pr.hp..][..pr.hp];
            logits_mv(qt, w, pr.hp, kb, dst);
            for (d, &j) in dst.iter_mut().zip(chunk) {
                if j as usize >= pr.vis[t] {
                    *d = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// Asks the cache for the records `ids` of `k` (entries, 68) while the current batch is scored:
/// a Reindex pool's entries are scattered over the whole cache (68 MB at 1M entries), and without
/// this each batch waits for its misses (and TLB walks) before any arithmetic starts. A hint only:
/// no effect on any result.
#[inline]
fn prefetch_records(k: &[u8], ids: &[u32]) {
    #[cfg(target_arch = "x86_64")]
    for &j in ids {
        let off = j as usize * MXFP4_INDEX_BYTES;
        if off + MXFP4_INDEX_BYTES <= k.len() {
            // SAFETY: prefetch never faults; both addresses lie inside `k` (checked above).
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                let p = k.as_ptr().add(off) as *const i8;
                _mm_prefetch::<_MM_HINT_T0>(p);
                _mm_prefetch::<_MM_HINT_T0>(p.add(MXFP4_INDEX_BYTES - 1));
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (k, ids);
}

/// A key batch's unpacked form for one of the narrow kernels.
trait KeyBatch {
    /// The MXFP4 records being scored (entries, 68).
    fn records(&self) -> &[u8];
    /// Unpacks entries `chunk` (at most [`KB`]).
    fn unpack(&mut self, chunk: &[u32]);
    /// Logits of query `t` against the `dst.len()` unpacked keys.
    fn score(&self, pr: &Prepared, t: usize, dst: &mut [f32]);
}

/// Scores every query of `outs` over batches of [`KB`] ids: batches no query sees are −∞ without
/// unpacking, and ids a query does not see are −∞ in its row.
fn for_batches(
    pr: &Prepared,
    t0: usize,
    ids: &[u32],
    outs: &mut [&mut [f32]],
    kb: &mut impl KeyBatch,
) {
    let mut next = ids.chunks(KB).skip(1);
    for (ci, chunk) in ids.chunks(KB).enumerate() {
        if let Some(n) = next.next() {
            prefetch_records(kb.records(), n);
        }
        let off = ci * KB;
        let first = chunk[0] as usize;
        if (0..outs.len()).all(|qi| first >= pr.vis[t0 + qi]) {
            for out in outs.iter_mut() {
                out[off..off + chunk.len()].fill(f32::NEG_INFINITY);
            }
            continue;
        }
        kb.unpack(chunk);
        for (qi, out) in outs.iter_mut().enumerate() {
            let t = t0 + qi;
            let dst = &mut out[off..off + chunk.len()];
            if first >= pr.vis[t] {
                dst.fill(f32::NEG_INFINITY);
                continue;
            }
            kb.score(pr, t, dst);
            for (d, &j) in dst.iter_mut().zip(chunk) {
                if j as usize >= pr.vis[t] {
                    *d = f32::NEG_INFINITY;
                }
            }
        }
    }
}

struct IntBatch<'a> {
    k: &'a [u8],
    keys: Box<IntKeys<KB>>,
}

impl KeyBatch for IntBatch<'_> {
    fn records(&self) -> &[u8] {
        self.k
    }
    fn unpack(&mut self, chunk: &[u32]) {
        dot::unpack_int(self.k, chunk, &mut self.keys);
    }
    fn score(&self, pr: &Prepared, t: usize, dst: &mut [f32]) {
        let iq = pr.iq.as_ref().expect("int8 kernel prepared");
        let w = &pr.w[t * pr.hp..][..pr.hp];
        dot::int_logits(iq, t, w, pr.hp, &self.keys, dst.len(), dst);
    }
}

fn score_ids_int(pr: &Prepared, t0: usize, k: &[u8], ids: &[u32], outs: &mut [&mut [f32]]) {
    let mut kb = IntBatch {
        k,
        keys: Box::new(IntKeys::new()),
    };
    for_batches(pr, t0, ids, outs, &mut kb);
}

/// Keys per bf16-kernel call: the kernel reads the records in place (16 KiB of them here, which
/// stay in L1 for every query of a prefill block) and prefetches its own next keys.
const BF16_CHUNK: usize = 240;

/// The bf16 kernel over `ids`: batches no query sees are −∞ without scoring, and ids a query does
/// not see are −∞ in its row (the same rules as [`for_batches`], over larger batches: this kernel
/// has no unpack step to keep in L1).
fn score_ids_bf16(pr: &Prepared, t0: usize, k: &[u8], ids: &[u32], outs: &mut [&mut [f32]]) {
    let bq = pr.bq.as_ref().expect("bf16 kernel prepared");
    for (ci, chunk) in ids.chunks(BF16_CHUNK).enumerate() {
        let off = ci * BF16_CHUNK;
        let first = chunk[0] as usize;
        for (qi, out) in outs.iter_mut().enumerate() {
            let t = t0 + qi;
            let dst = &mut out[off..off + chunk.len()];
            if first >= pr.vis[t] {
                dst.fill(f32::NEG_INFINITY);
                continue;
            }
            let w = &pr.w[t * pr.hp..][..pr.hp];
            dot::bf16_logits(bq, t, w, pr.hp, k, chunk, dst);
            for (d, &j) in dst.iter_mut().zip(chunk) {
                if j as usize >= pr.vis[t] {
                    *d = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// Entries `ids` as f32 rows (the exact reference values): f32 keys with consecutive ids are used
/// in place, anything else is decoded / copied into `buf`.
fn key_rows<'a>(
    isa: fast::Isa,
    keys: &IndexKeys<'a>,
    ids: &[u32],
    buf: &'a mut [[f32; INDEX_DIM]; KB],
) -> &'a [[f32; INDEX_DIM]] {
    let (first, last) = (ids[0] as usize, ids[ids.len() - 1] as usize);
    match keys {
        IndexKeys::F32(k) if last - first + 1 == ids.len() => {
            k[first * INDEX_DIM..(last + 1) * INDEX_DIM]
                .as_chunks::<INDEX_DIM>()
                .0
        }
        IndexKeys::F32(k) => {
            for (o, &j) in buf.iter_mut().zip(ids) {
                o.copy_from_slice(&k[j as usize * INDEX_DIM..][..INDEX_DIM]);
            }
            &buf[..ids.len()]
        }
        IndexKeys::Mxfp4(k) => {
            for (o, &j) in buf.iter_mut().zip(ids) {
                let rec = &k[j as usize * MXFP4_INDEX_BYTES..][..MXFP4_INDEX_BYTES];
                let (d, s) = rec.split_at(64);
                fast::decode_row(isa, RecordFormat::Mxfp4Index, d, s, o);
            }
            &buf[..ids.len()]
        }
    }
}

multiversion!(
    logits_mv,
    fn(qt: &[f32], w: &[f32], hp: usize, keys: &[[f32; INDEX_DIM]], out: &mut [f32]),
    logits_body
);

/// `out[k] = Σ_h w[h] · ReLU(Σ_d qt[d][h] · keys[k][d])` for every row of `keys`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // d indexes both qt and every key row of the block
fn logits_body<V: Vf32>(
    qt: &[f32],
    w: &[f32],
    hp: usize,
    keys: &[[f32; INDEX_DIM]],
    out: &mut [f32],
) {
    assert!(qt.len() == INDEX_DIM * hp && w.len() == hp && hp.is_multiple_of(HPAD));
    assert!(out.len() == keys.len());
    let l = V::L;
    let zero = V::splat(0.0);
    for (kk, dst) in keys.chunks(NK).zip(out.chunks_mut(NK)) {
        // A short last group repeats its last key; the extra results are not stored.
        let kr: [&[f32; INDEX_DIM]; NK] = std::array::from_fn(|i| &kk[i.min(kk.len() - 1)]);
        let mut lv = [zero; NK];
        for h0 in (0..hp).step_by(2 * l) {
            let mut acc = [[zero; 2]; NK];
            for d in 0..INDEX_DIM {
                // SAFETY: h0 + 2L ≤ hp (hp is a multiple of 32 ≥ 2L), so d·hp + h0 + 2L ≤ qt.len().
                let (q0, q1) = unsafe {
                    let p = qt.as_ptr().add(d * hp + h0);
                    (V::load(p), V::load(p.add(l)))
                };
                for i in 0..NK {
                    let b = V::splat(kr[i][d]);
                    acc[i][0] = V::fmadd(q0, b, acc[i][0]);
                    acc[i][1] = V::fmadd(q1, b, acc[i][1]);
                }
            }
            // SAFETY: h0 + 2L ≤ hp = w.len().
            let (w0, w1) =
                unsafe { (V::load(w.as_ptr().add(h0)), V::load(w.as_ptr().add(h0 + l))) };
            for i in 0..NK {
                lv[i] = V::fmadd(w0, V::max(acc[i][0], zero), lv[i]);
                lv[i] = V::fmadd(w1, V::max(acc[i][1], zero), lv[i]);
            }
        }
        for (o, v) in dst.iter_mut().zip(lv) {
            *o = v.hsum();
        }
    }
}

/// Where one thread's time goes in a narrow-dot kernel (benchmarks: `csa2 bench ops`), in thread
/// CPU time, the minimum of `reps` runs each.
#[derive(Debug, Clone, Copy)]
pub struct KernelBreakdown {
    /// The kernel measured.
    pub kernel: DotKernel,
    /// Unpacking MXFP4 records into kernel order (nibbles → bytes, scales, offset sums), ns/key;
    /// 0 for the bf16 kernel, which reads the records in place.
    pub unpack_ns: f64,
    /// Scoring one L1-resident batch of keys over and over, ns/key.
    pub score_hot_ns: f64,
    /// The whole per-batch loop (prefetch, unpack, score, visibility) over `n` keys, ns/key.
    pub total_ns: f64,
}

/// Times the narrow kernel's parts on the calling thread over the first `n` records of `k`
/// (entries, 68), query 0 of `pr`; `None` unless `pr` runs [`DotKernel::Int8`] or
/// [`DotKernel::Bf16`].
pub fn kernel_breakdown(pr: &Prepared, k: &[u8], n: usize, reps: usize) -> Option<KernelBreakdown> {
    use crate::ops::simd::thread_cpu_seconds as now;
    if pr.kernel == DotKernel::F32 || n < KB || k.len() < n * MXFP4_INDEX_BYTES {
        return None;
    }
    let n = n / KB * KB;
    let hot_n = match pr.kernel {
        DotKernel::Bf16 if n >= BF16_CHUNK => n / BF16_CHUNK * BF16_CHUNK,
        DotKernel::Bf16 => return None,
        _ => n,
    };
    let ids: Vec<u32> = (0..n as u32).collect();
    let mut keys = Box::new(IntKeys::<KB>::new());
    let w = &pr.w[..pr.hp];
    let mut out = vec![0f32; n];
    let mut best = [f64::INFINITY; 3];
    for _ in 0..reps.max(1) {
        let t0 = now();
        if pr.kernel == DotKernel::Int8 {
            for c in ids.chunks_exact(KB) {
                dot::unpack_int(k, c, &mut keys);
                std::hint::black_box(&keys);
            }
        }
        let t1 = now();
        match (&pr.iq, &pr.bq) {
            (Some(iq), _) => {
                for o in out.chunks_exact_mut(KB) {
                    dot::int_logits(iq, 0, w, pr.hp, &keys, KB, o);
                }
            }
            (_, Some(bq)) => {
                for o in out[..hot_n].chunks_exact_mut(BF16_CHUNK) {
                    dot::bf16_logits(bq, 0, w, pr.hp, k, &ids[..BF16_CHUNK], o);
                }
            }
            _ => unreachable!("a narrow kernel is prepared"),
        }
        std::hint::black_box(&out);
        let t2 = now();
        // Hot scoring covers `hot_n` keys; the other two figures all `n`.
        let t2h = t1 + (t2 - t1) * n as f64 / hot_n as f64;
        score_ids(pr, 0, &IndexKeys::Mxfp4(k), &ids, &mut [&mut out[..]]);
        let t3 = now();
        for (b, t) in best.iter_mut().zip([t1 - t0, t2h - t1, t3 - t2]) {
            *b = b.min(t);
        }
    }
    let per = 1e9 / n as f64;
    Some(KernelBreakdown {
        kernel: pr.kernel,
        unpack_ns: best[0] * per,
        score_hot_ns: best[1] * per,
        total_ns: best[2] * per,
    })
}
