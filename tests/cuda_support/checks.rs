//! GPU-vs-CPU checks, shared by `tests/cuda.rs` (small sizes, no timing) and the GPU validation
//! binary (`examples/gpu_validate.rs`: realistic sizes, CUDA-event timings).
//!
//! Every check draws fresh random inputs (seeded; the seed is in the report), runs the kernel through
//! the host API, compares to the CPU reference (special values first, then element bounds and cosine,
//! FlashMLA style), and reruns the kernel to check it is bitwise deterministic.
#![allow(dead_code)]

use super::host::{self, attention_ref, table_slot, Pool};
use csa2::cuda::attention::{DecodeBatch, TablePages};
use csa2::cuda::CudaDevice;
use csa2::formats::RecordFormat;
use csa2::geometry::Geometry;
use csa2::ops::candidates::{reference as candidates_ref, CandidateParams};
use csa2::ops::compressor::{self, CarryState, Compressor, CompressorBatch, PooledWeights};
use csa2::ops::indexer::{self, IndexCache, IndexerParams, IndexerQueries};
use csa2::ops::mhc::{self, MhcParams, MixWeights, PostUpdate};
use csa2::ops::rope::Rope;
use csa2::ops::topk::reference::select_rows as topk_ref;
use csa2::tensor::{Device, Element, TensorView, TensorViewMut};
use csa2::tolerance::{compare, Stats, Tolerance, GPU_BF16_VS_F64, GPU_F32_VS_F64, QUANT_VS_EXACT};
use csa2::Result;
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

const KV: usize = csa2::formats::KV_DIM;
const IDX: usize = csa2::formats::INDEX_DIM;

/// Whether the kernels run as a sanitizer build of the host SIMT harness (`CSA2_EMU_SANITIZER`,
/// scripts/simt-sanitizers.sh). A race or an out-of-bounds access shows on the first tiles a kernel
/// loops over, not on the hundredth, while every instrumented access costs about a hundred times
/// its plain one; the costliest checks then keep every case and code path but fewer keys.
pub fn sanitized() -> bool {
    std::env::var_os("CSA2_EMU_SANITIZER").is_some_and(|v| !v.is_empty())
}

/// Problem sizes: `small` for tests on any GPU in seconds, `large` for validation at model shapes.
#[derive(Clone, Copy, Debug)]
pub struct Size {
    pub large: bool,
    /// Timed iterations (0 = no timing).
    pub iters: usize,
}

#[derive(Debug)]
pub struct Report {
    pub name: String,
    pub ok: bool,
    pub detail: String,
    /// (median µs, bytes moved per call) when timed.
    pub timing: Option<(f64, f64)>,
}

impl Report {
    fn new(name: impl Into<String>) -> Report {
        Report {
            name: name.into(),
            ok: true,
            detail: String::new(),
            timing: None,
        }
    }
    fn check(&mut self, what: &str, ok: bool, info: impl std::fmt::Display) {
        self.ok &= ok;
        self.detail.push_str(&format!(
            "{} {what}: {info}\n",
            if ok { "ok  " } else { "FAIL" }
        ));
    }
    fn stats<A: Into<f64> + Copy, B: Into<f64> + Copy>(
        &mut self,
        what: &str,
        a: &[A],
        b: &[B],
        tol: &Tolerance,
    ) -> Stats {
        let s = compare(a, b, tol);
        self.check(
            what,
            s.ok(tol),
            format!(
                "max_abs {:.3e} max_rel {:.3e} 1-cos {:.3e} violations {} special-mismatch {}",
                s.max_abs, s.max_rel, s.cos_diff, s.violations, s.special_mismatches
            ),
        );
        s
    }
}

fn normal(rng: &mut StdRng, n: usize, sd: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v: f32 = StandardNormal.sample(rng);
            v * sd
        })
        .collect()
}

fn bits_eq_f32(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Median wall time (µs) of `f` over `iters` runs, timed with CUDA events after 3 warm-ups.
pub fn time_us(dev: &CudaDevice, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    use csa2::cuda::driver::sys::CUevent_flags;
    for _ in 0..3 {
        f()?;
    }
    let ctx = dev.context();
    let err = |e: csa2::cuda::driver::DriverError| csa2::Error::Cuda {
        op: "event".into(),
        reason: e.to_string(),
    };
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters {
        let a = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(err)?;
        let b = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(err)?;
        a.record(dev.stream()).map_err(err)?;
        f()?;
        b.record(dev.stream()).map_err(err)?;
        b.synchronize().map_err(err)?;
        v.push(a.elapsed_ms(&b).map_err(err)? as f64 * 1e3);
    }
    dev.synchronize()?;
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(v[v.len() / 2])
}

/// CudaDevice-to-device copy bandwidth (GB/s, bytes read + bytes written) over a 1 GiB buffer.
pub fn copy_bandwidth(dev: &CudaDevice, iters: usize) -> Result<f64> {
    let n = 1usize << 30;
    let src = dev.zeros::<u8>(n)?;
    let mut dst = dev.zeros::<u8>(n)?;
    let us = time_us(dev, iters, || {
        dev.stream()
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| csa2::Error::Cuda {
                op: "memcpy".into(),
                reason: e.to_string(),
            })
    })?;
    Ok(2.0 * n as f64 / (us * 1e-6) / 1e9)
}

/// A pool with `pages` pages and, per request, a shuffled block table of `max_blocks` pages
/// (requests × max_blocks ≤ pages), every `hole`-th block left unmapped (-1) when `holes`.
fn block_tables(
    rng: &mut StdRng,
    requests: usize,
    max_blocks: usize,
    pages: usize,
    holes: bool,
) -> Vec<i32> {
    let mut ids: Vec<i32> = (0..pages as i32).collect();
    for i in (1..ids.len()).rev() {
        let j = rng.random_range(0..=i);
        ids.swap(i, j);
    }
    let mut bt: Vec<i32> = ids.into_iter().take(requests * max_blocks).collect();
    if holes {
        for (i, b) in bt.iter_mut().enumerate() {
            if i % 7 == 5 {
                *b = -1;
            }
        }
    }
    bt
}

// ---- 1. codecs ------------------------------------------------------------------------------------------

/// Special values every codec check includes (ties, saturation, NaN, ±0, subnormal scales).
fn special_row(dim: usize, rng: &mut StdRng) -> Vec<f32> {
    let specials = [
        0.25f32,
        -0.25,
        0.75,
        1.25,
        1.75,
        2.5,
        3.5,
        5.0,
        -5.0001,
        6.5,
        448.0,
        464.0,
        1e30,
        -0.0,
        0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e-30,
        -1e-38,
        2.0e-45,
        7.0,
        -7.0,
        1e-4,
    ];
    let mut v = normal(rng, dim, 1.0);
    for (i, s) in specials.iter().enumerate() {
        v[(i * 5) % dim] = *s;
    }
    v
}

pub fn check_codec(dev: &CudaDevice, fmt: RecordFormat, size: Size, seed: u64) -> Result<Report> {
    let mut rep = Report::new(format!("codec {}", fmt.name()));
    let mut rng = StdRng::seed_from_u64(seed);
    let dim = fmt.dim();
    let (page_slots, pages, rows) = if size.large {
        (64, 4096, 65536)
    } else {
        (16, 24, 300)
    };
    let mut x = Vec::with_capacity(rows * dim);
    for r in 0..rows {
        match r % 5 {
            0 => x.extend(special_row(dim, &mut rng)),
            1 => x.extend(normal(&mut rng, dim, 1e-3)),
            2 => x.extend(normal(&mut rng, dim, 300.0)),
            3 => x.extend(vec![0.0f32; dim]),
            _ => x.extend(normal(&mut rng, dim, 1.0)),
        }
    }
    // Distinct slots across all pages (page boundaries included), every 11th row skipped (-1).
    let mut slots: Vec<i64> = (0..(pages * page_slots) as i64).collect();
    for i in (1..slots.len()).rev() {
        let j = rng.random_range(0..=i);
        slots.swap(i, j);
    }
    slots.truncate(rows);
    for (i, s) in slots.iter_mut().enumerate() {
        if i % 11 == 10 {
            *s = -1;
        }
    }
    let mut cpu = Pool::new(fmt, page_slots, pages);
    let init: Vec<u8> = (0..cpu.bytes.len()).map(|i| (i * 31 % 251) as u8).collect();
    cpu.bytes.copy_from_slice(&init);
    for (r, &s) in slots.iter().enumerate() {
        if s >= 0 {
            cpu.write_slot(s as usize, &x[r * dim..(r + 1) * dim]);
        }
    }
    let mut gpu = init.clone();
    host::encode_pages(dev, fmt, &x, &slots, &mut gpu, page_slots)?;
    let diff = gpu.iter().zip(&cpu.bytes).filter(|(a, b)| a != b).count();
    rep.check(
        "page bytes == CPU (incl. untouched slots)",
        diff == 0,
        format!("{diff} of {} bytes differ", gpu.len()),
    );
    let mut again = init.clone();
    host::encode_pages(dev, fmt, &x, &slots, &mut again, page_slots)?;
    rep.check("bitwise rerun", again == gpu, "");

    let dec = host::decode_pages(dev, fmt, &cpu.bytes, &slots, page_slots)?;
    let mut want = vec![0f32; rows * dim];
    for (r, &s) in slots.iter().enumerate() {
        if s >= 0 {
            want[r * dim..(r + 1) * dim].copy_from_slice(&cpu.read_slot(s as usize));
        }
    }
    rep.check("decode == CPU bit for bit", bits_eq_f32(&dec, &want), "");

    if size.iters > 0 {
        let dx = dev.upload(&x)?;
        let ds = dev.upload(&slots)?;
        let mut dp = dev.upload(&gpu)?;
        let n = slots.len();
        let layout = cpu.layout;
        let us = time_us(dev, size.iters, || {
            csa2::formats::cuda::encode_into_pages(dev, &layout, &dx, &ds, &mut dp, n)
        })?;
        rep.timing = Some((us, (n * (dim * 4 + 8 + fmt.record_bytes())) as f64));
    }
    Ok(rep)
}

// ---- 2. compressor --------------------------------------------------------------------------------------

pub fn check_compressor(dev: &CudaDevice, ratio: usize, size: Size, seed: u64) -> Result<Report> {
    let mut rep = Report::new(format!("compressor ratio {ratio}"));
    let mut rng = StdRng::seed_from_u64(seed);
    let geo = Geometry::embedded();
    let layer = geo
        .layers
        .iter()
        .find(|l| l.ratio == ratio)
        .expect("a layer with this ratio");
    let norm_w: Vec<f32> = (0..KV).map(|_| rng.random_range(0.5..1.5)).collect();
    let k_norm_w: Vec<f32> = (0..IDX).map(|_| rng.random_range(0.5..1.5)).collect();
    let wk = normal(&mut rng, IDX * KV, (KV as f32).powf(-0.5));
    let c = Compressor::new(
        ratio,
        csa2::geometry::consts::RMS_NORM_EPS,
        Rope::for_layer(layer),
        PooledWeights {
            norm: &norm_w,
            wk: &wk,
            k_norm: &k_norm_w,
        },
    )?;
    // Chunk lengths per request and call: odd and even boundaries, empty chunks, page crossings.
    // Under a sanitizer the same cases at a quarter of the scale: 16-entry pages and chunks of 16
    // and 17 tokens where the plain run has 64, 65 and 130.
    let page_slots = if sanitized() { 16 } else { 64 };
    let calls: Vec<Vec<usize>> = if size.large {
        vec![
            vec![4095, 1, 8192, 2, 77, 300, 129, 1024],
            vec![1; 8],
            vec![2, 3, 0, 64, 1, 1, 255, 128],
        ]
    } else if sanitized() {
        vec![
            vec![1, 2, 17, 34, 0],
            vec![1, 1, 16, 3, 7],
            vec![2, 0, 1, 16, 1],
        ]
    } else {
        vec![
            vec![1, 2, 65, 130, 0],
            vec![1, 1, 64, 3, 7],
            vec![2, 0, 1, 64, 1],
        ]
    };
    let requests = calls[0].len();
    let total: Vec<usize> = (0..requests)
        .map(|r| calls.iter().map(|c| c[r]).sum())
        .collect();
    let max_blocks = total
        .iter()
        .max()
        .unwrap()
        .div_ceil(ratio)
        .div_ceil(page_slots)
        + 1;
    let pages = requests * max_blocks + 3;
    let bt = block_tables(&mut rng, requests, max_blocks, pages, false);
    let mut main_cpu = Pool::new(RecordFormat::Nvfp4Ds, page_slots, pages);
    let mut index_cpu = Pool::new(RecordFormat::Mxfp4Index, page_slots, pages);
    let mut main_gpu = main_cpu.bytes.clone();
    let mut index_gpu = index_cpu.bytes.clone();
    let mut st_cpu = CarryState::new(requests);
    let mut st_gpu = CarryState::new(requests);
    let mut pos = vec![0i32; requests];
    let mut ref_entries = vec![];
    let mut last_inputs = None;
    for lens in &calls {
        let mut cu = vec![0i32];
        for &l in lens {
            cu.push(cu.last().unwrap() + l as i32);
        }
        let tokens = *cu.last().unwrap() as usize;
        let kv = normal(&mut rng, tokens * KV, 1.0);
        let score = normal(&mut rng, tokens * KV, 2.0);
        let score_opt = (ratio == 2).then_some(score.as_slice());
        let b = CompressorBatch {
            kv: &kv,
            score: score_opt,
            cu_tokens: &cu,
            start_pos: &pos,
            block_table: &bt,
            max_blocks,
            page_slots,
        };
        ref_entries.extend(compressor::reference::compress_paged(
            &c,
            &b,
            &mut st_cpu,
            &mut main_cpu.bytes,
            &mut index_cpu.bytes,
        )?);
        host::compress(dev, &c, &b, &mut st_gpu, &mut main_gpu, &mut index_gpu)?;
        last_inputs = Some((kv, score, cu, pos.clone()));
        for (p, &l) in pos.iter_mut().zip(lens) {
            *p += l as i32;
        }
    }
    rep.check(
        "carry state == CPU",
        st_cpu == st_gpu,
        format!("positions {:?}", st_gpu.pos),
    );
    for (what, cpu, gpu) in [
        ("main-KV", &main_cpu, &main_gpu),
        ("index-K", &index_cpu, &index_gpu),
    ] {
        let diff = gpu.iter().zip(&cpu.bytes).filter(|(a, b)| a != b).count();
        // Codes may flip where the f32 kernel and the f64 reference straddle a rounding boundary.
        rep.check(
            &format!("{what} page bytes vs CPU"),
            (diff as f64) <= 2e-3 * cpu.bytes.len() as f64,
            format!("{diff} of {} bytes differ", cpu.bytes.len()),
        );
    }
    // Dequantized GPU records against the unquantized reference rows.
    let gmain = Pool {
        layout: main_cpu.layout,
        bytes: main_gpu.clone(),
    };
    let gidx = Pool {
        layout: index_cpu.layout,
        bytes: index_gpu.clone(),
    };
    let (mut got, mut want, mut goti, mut wanti) = (vec![], vec![], vec![], vec![]);
    for e in &ref_entries {
        let slot = e
            .slot
            .expect("every entry is mapped (no holes in these tables)");
        got.extend(gmain.read_slot(slot));
        want.extend(e.main_kv.iter().copied());
        goti.extend(gidx.read_slot(slot));
        wanti.extend(e.index_k.iter().copied());
    }
    rep.check(
        "entries written",
        !ref_entries.is_empty(),
        format!("{} entries", ref_entries.len()),
    );
    rep.stats(
        "main KV (dequantized) vs unquantized",
        &got,
        &want,
        &QUANT_VS_EXACT,
    );
    rep.stats(
        "index K (dequantized) vs unquantized",
        &goti,
        &wanti,
        &QUANT_VS_EXACT,
    );

    if size.iters > 0 {
        let (kv, score, cu, pos) = last_inputs.unwrap();
        let tokens = *cu.last().unwrap() as usize;
        let mut main = main_gpu.clone();
        let mut idx = index_gpu.clone();
        // The staged host form (includes copies) is what is cheap to time here; report it as such.
        let mut st = st_gpu.clone();
        let us = time_us(dev, size.iters.min(10), || {
            st = st_gpu.clone();
            host::compress(
                dev,
                &c,
                &CompressorBatch {
                    kv: &kv,
                    score: (ratio == 2).then_some(score.as_slice()),
                    cu_tokens: &cu,
                    start_pos: &pos,
                    block_table: &bt,
                    max_blocks,
                    page_slots,
                },
                &mut st,
                &mut main,
                &mut idx,
            )
        })?;
        rep.timing = Some((us, (tokens * KV * 4 * ratio) as f64));
        rep.detail
            .push_str("note: compressor timing includes host↔device copies of the pools\n");
    }
    Ok(rep)
}

// ---- 3. indexer ------------------------------------------------------------------------------------------

pub fn check_indexer(
    dev: &CudaDevice,
    prefill: bool,
    masked: bool,
    size: Size,
    seed: u64,
) -> Result<Report> {
    let mut rep = Report::new(format!(
        "indexer logits {}{}",
        if prefill { "prefill" } else { "decode" },
        if masked { " + candidate mask" } else { "" }
    ));
    let mut rng = StdRng::seed_from_u64(seed);
    let page_slots = 64;
    let ratio = if masked { 1 } else { 2 };
    let (requests, ctx) = if size.large {
        (8, 65536usize)
    } else {
        (3, 700)
    };
    let entries = ctx / ratio;
    let max_blocks = entries.div_ceil(page_slots);
    let pages = requests * max_blocks + 2;
    let bt = block_tables(&mut rng, requests, max_blocks, pages, !size.large);
    let mut index = Pool::new(RecordFormat::Mxfp4Index, page_slots, pages);
    for r in 0..requests {
        for j in 0..entries {
            if let Some(slot) = table_slot(
                &bt[r * max_blocks..(r + 1) * max_blocks],
                j as i64,
                page_slots,
            ) {
                let row = normal(&mut rng, IDX, 1.0);
                index.write_slot(slot, &row);
            }
        }
    }
    // Rows: decode = one per request at assorted positions; prefill = a run of positions per request.
    let (mut pos, mut req) = (vec![], vec![]);
    for r in 0..requests {
        if prefill {
            let n = if size.large { 16 } else { 9 };
            let start = ctx - n - r;
            for p in start..start + n {
                pos.push(p as i32);
                req.push(r as i32);
            }
        } else {
            let choices = [0usize, 1, 2, 511 * ratio, 512 * ratio, ctx - 1];
            pos.push(choices[r % choices.len()].min(ctx - 1) as i32);
            req.push(r as i32);
        }
    }
    let t = pos.len();
    let q = normal(&mut rng, t * 32 * IDX, 1.0);
    let w: Vec<f32> = normal(&mut rng, t * 32, 1.0)
        .iter()
        .map(|v| v / 64.0)
        .collect();
    let nb = entries.div_ceil(8);
    let mask: Vec<u8> = (0..t * nb).map(|i| u8::from(i % 3 != 1)).collect();
    let cand = masked.then_some((mask.as_slice(), nb));
    let positions: Vec<i64> = pos.iter().map(|&p| p as i64).collect();
    let qs = IndexerQueries {
        q: &q,
        w: &w,
        positions: &positions,
    };
    let cache = IndexCache {
        pages: &index.bytes,
        block_table: &bt,
        max_blocks,
        page_slots,
    };
    let ip = IndexerParams::new(ratio);
    let got = host::indexer_logits(dev, &ip, &qs, &req, &cache, cand, entries)?;
    let want = indexer::reference::logits_paged(&ip, &qs, &req, &cache, cand, entries);
    rep.stats(
        "logits vs f64 reference (−Inf positions first)",
        &got,
        &want,
        &GPU_F32_VS_F64,
    );
    // (Under a sanitizer the rerun is left out, as in the attention check: time, not evidence.)
    if !sanitized() {
        let again = host::indexer_logits(dev, &ip, &qs, &req, &cache, cand, entries)?;
        rep.check("bitwise rerun", bits_eq_f32(&again, &got), "");
    }

    // Top-512 of these logits: same selection as the CPU top-k of the GPU logits (exact), and of the
    // f64 logits by overlap (ties / near-ties may swap).
    let n_valid: Vec<i32> = pos
        .iter()
        .map(|&p| ((p as usize + 1) / ratio).min(entries) as i32)
        .collect();
    let sel = host::topk(dev, &got, entries, &n_valid, 512)?;
    rep.check(
        "top-512 == CPU top-k of the same logits",
        sel == topk_ref(&got, entries, &n_valid, 512),
        "",
    );
    let want32: Vec<f32> = want.iter().map(|&v| v as f32).collect();
    let sel_ref = topk_ref(&want32, entries, &n_valid, 512);
    let inter = (0..t)
        .map(|r| {
            let a: std::collections::HashSet<_> = sel[r * 512..(r + 1) * 512]
                .iter()
                .filter(|&&v| v >= 0)
                .collect();
            sel_ref[r * 512..(r + 1) * 512]
                .iter()
                .filter(|v| **v >= 0 && a.contains(v))
                .count()
        })
        .sum::<usize>();
    let total = sel_ref.iter().filter(|&&v| v >= 0).count();
    rep.check(
        "top-512 overlap with the f64 selection",
        inter as f64 >= 0.99 * total as f64,
        format!("{inter} of {total}"),
    );

    if size.iters > 0 {
        let dq = dev.upload(&q)?;
        let dw = dev.upload(&w)?;
        let dpos = dev.upload(&pos)?;
        let dreq = dev.upload(&req)?;
        let dbt = dev.upload(&bt)?;
        let dpages = dev.upload(&index.bytes)?;
        let dmask = dev.upload(&mask)?;
        let mut out = dev.zeros::<f32>(t * entries)?;
        let dq_rows = indexer::cuda::DeviceQueries {
            q: &dq,
            w: &dw,
            pos: &dpos,
            req: &dreq,
            rows: t,
        };
        let dcache = indexer::cuda::DeviceIndexCache {
            pages: &dpages,
            block_table: &dbt,
            max_blocks,
            page_slots,
        };
        let us = time_us(dev, size.iters, || {
            indexer::cuda::logits(
                dev,
                &ip,
                &dq_rows,
                &dcache,
                masked.then_some((&dmask, nb)),
                &mut out,
                entries,
            )
        })?;
        let visible: usize = n_valid.iter().map(|&v| v as usize).sum();
        rep.timing = Some((us, (visible * (68 + 4) + t * 32 * 129 * 4) as f64));
    }
    Ok(rep)
}

// ---- 4. top-k and candidates ------------------------------------------------------------------------------

pub fn check_topk(dev: &CudaDevice, size: Size, seed: u64) -> Result<Report> {
    let mut rep = Report::new("top-k 512 (radix select)");
    let mut rng = StdRng::seed_from_u64(seed);
    let n_cols = if size.large { 1 << 20 } else { 5000 };
    let valids: Vec<i32> = if size.large {
        vec![1 << 20, 262_144, 65_536, 513, 512, 100_000, 1_000_000, 4096]
    } else {
        vec![0, 1, 511, 512, 513, 1023, 1024, 1025, 5000, 4999, 2000, 700]
    };
    let t = valids.len();
    let mut keys = vec![0f32; t * n_cols];
    for (r, row) in keys.chunks_mut(n_cols).enumerate() {
        for (i, v) in row.iter_mut().enumerate() {
            *v = match r % 4 {
                // Heavy ties: few distinct values.
                0 => rng.random_range(0..5) as f32,
                // Non-finite and masked entries mixed in.
                1 => match i % 13 {
                    0 => f32::NEG_INFINITY,
                    5 => f32::NAN,
                    _ => StandardNormal.sample(&mut rng),
                },
                // Mostly −Inf: fewer selectable than k.
                2 => {
                    if i % 3 == 0 && i < 900 {
                        StandardNormal.sample(&mut rng)
                    } else {
                        f32::NEG_INFINITY
                    }
                }
                _ => StandardNormal.sample(&mut rng),
            };
        }
    }
    let got = host::topk(dev, &keys, n_cols, &valids, 512)?;
    let want = topk_ref(&keys, n_cols, &valids, 512);
    let bad: Vec<usize> = (0..t)
        .filter(|&r| got[r * 512..(r + 1) * 512] != want[r * 512..(r + 1) * 512])
        .collect();
    rep.check(
        "selection == CPU (ties → smaller index, −Inf/NaN never)",
        bad.is_empty(),
        format!("rows differing: {bad:?}"),
    );
    let got2 = host::topk(dev, &keys, n_cols, &valids, 2048)?;
    rep.check(
        "k = 2048 == CPU",
        got2 == topk_ref(&keys, n_cols, &valids, 2048),
        "",
    );
    if size.iters > 0 {
        let dk = dev.upload(&keys)?;
        let dn = dev.upload(&valids)?;
        let mut out = dev.zeros::<i32>(t * 512)?;
        let us = time_us(dev, size.iters, || {
            csa2::ops::topk::cuda::select_rows(dev, &dk, n_cols, &dn, 512, &mut out, t)
        })?;
        let read: usize = valids
            .iter()
            .map(|&v| (v as usize).min(n_cols) * 4 * 5)
            .sum();
        rep.timing = Some((us, read as f64));
        rep.detail.push_str(
            "note: bytes = 5 passes over the visible keys (4 radix passes + compaction)\n",
        );
    }
    Ok(rep)
}

pub fn check_candidates(dev: &CudaDevice, size: Size, seed: u64) -> Result<Report> {
    let mut rep = Report::new("candidate pool (block max, pin, top-2048 blocks)");
    let mut rng = StdRng::seed_from_u64(seed);
    let n_cols = if size.large { 262_144 } else { 20_000 };
    let valids: Vec<i32> = vec![
        n_cols as i32,
        16_384,
        16_385,
        16_383,
        17_000,
        8,
        1,
        0,
        19_999,
    ];
    let t = valids.len();
    let mut keys: Vec<f32> = (0..t * n_cols)
        .map(|_| rng.random_range(0..1000) as f32 / 100.0)
        .collect();
    // Row 3 (2,048 blocks, so every finite one is kept): only every 8th block finite; the −∞
    // blocks stay out of the mask (the list is `ops::candidates`' contract, not "all visible").
    for (i, v) in keys[3 * n_cols..4 * n_cols].iter_mut().enumerate() {
        if i % 64 >= 8 {
            *v = f32::NEG_INFINITY;
        }
    }
    let (mask, stride) = host::candidate_mask(dev, &keys, n_cols, &valids)?;
    let want = candidates_ref::pool_mask(&CandidateParams::default(), &keys, n_cols, &valids);
    rep.check(
        "pool mask == CPU",
        mask == want && stride == n_cols.div_ceil(8),
        format!("stride {stride}"),
    );
    let kept: Vec<usize> = (0..t)
        .map(|r| {
            mask[r * stride..(r + 1) * stride]
                .iter()
                .filter(|&&m| m == 1)
                .count()
        })
        .collect();
    rep.check(
        "kept blocks ≤ 2048",
        kept.iter().all(|&k| k <= 2048),
        format!("{kept:?}"),
    );
    Ok(rep)
}

// ---- 5. attention ------------------------------------------------------------------------------------------

pub fn check_attention(dev: &CudaDevice, size: Size, seed: u64) -> Result<Report> {
    let mut rep = Report::new("sparse decode attention (NVFP4-DS + MXFP8 pages)");
    let mut rng = StdRng::seed_from_u64(seed);
    let geo = Geometry::embedded();
    let inv_freq = geo.layers[20].rope.inv_freqs();
    let rope = Rope::for_layer(&geo.layers[20]);
    let (requests, ctx) = if size.large {
        (64, 8192usize)
    } else {
        (6, 1300)
    };
    let page_slots = 64;
    let main_max = ctx.div_ceil(page_slots);
    let main_pages = requests * main_max + 1;
    let main_bt = block_tables(&mut rng, requests, main_max, main_pages, !size.large);
    let swa_max = ctx.div_ceil(page_slots);
    let swa_pages = requests * swa_max + 1;
    let swa_bt = block_tables(&mut rng, requests, swa_max, swa_pages, false);
    let mut main = Pool::new(RecordFormat::Nvfp4Ds, page_slots, main_pages);
    let mut swa = Pool::new(RecordFormat::Mxfp8, page_slots, swa_pages);
    // Only the rows the queries can reach are filled; the rest stay zero bytes (valid records).
    let pos: Vec<i32> = (0..requests)
        .map(|r| match r % 6 {
            0 => 0,
            1 => 5,
            2 => 127,
            3 => 128,
            4 => (ctx - 1) as i32,
            _ => (ctx / 2) as i32,
        })
        .collect();
    for r in 0..requests {
        for j in 0..ctx {
            if let Some(s) = table_slot(
                &main_bt[r * main_max..(r + 1) * main_max],
                j as i64,
                page_slots,
            ) {
                main.write_slot(s, &normal(&mut rng, KV, 1.0));
            }
        }
        let p = pos[r] as usize;
        for j in p.saturating_sub(127)..=p {
            if let Some(s) = table_slot(
                &swa_bt[r * swa_max..(r + 1) * swa_max],
                j as i64,
                page_slots,
            ) {
                swa.write_slot(s, &normal(&mut rng, KV, 1.0));
            }
        }
    }
    // The released top-k (512); under a sanitizer 40 (two full 16-key tiles and a partial one,
    // plus the window's tiles).
    let topk_len = if sanitized() { 40 } else { 512 };
    let mut topk = vec![-1i32; requests * topk_len];
    for r in 0..requests {
        let vis = (pos[r] as usize + 1).min(ctx);
        for i in 0..topk_len {
            // Row 0: everything masked (the window still has its own token); others: a random subset.
            if r % 6 != 0 && i < vis && rng.random_range(0..8) != 0 {
                topk[r * topk_len + i] = rng.random_range(0..vis as i32);
            }
        }
    }
    let window_start: Vec<i32> = (0..requests)
        .map(|r| if r % 6 == 4 { pos[r] - 40 } else { 0 })
        .collect();
    let q = normal(&mut rng, requests * 64 * KV, 1.0);
    let sink: Vec<f32> = normal(&mut rng, 64, 1.0);
    let scale = (KV as f32).powf(-0.5);
    let reqs: Vec<i32> = (0..requests as i32).collect();
    fn hv<'v>(s: &'v [i32], shape: &[usize]) -> TensorView<'v> {
        TensorView::from_host_slice(s, shape).unwrap()
    }
    let b = DecodeBatch {
        q: TensorView::from_host_slice(&q, &[requests, 64, KV])?,
        topk: hv(&topk, &[requests, topk_len]),
        pos: hv(&pos, &[requests]),
        req: hv(&reqs, &[requests]),
        window_start: hv(&window_start, &[requests]),
        sink: Some(TensorView::from_host_slice(&sink, &[64])?),
        inv_freq: Some(&inv_freq),
        scale,
    };
    let mc = TablePages {
        pages: TensorView::from_host_slice(&main.bytes, &[main.bytes.len()])?,
        block_table: hv(&main_bt, &[requests, main_max]),
        page_slots,
    };
    let sc = TablePages {
        pages: TensorView::from_host_slice(&swa.bytes, &[swa.bytes.len()])?,
        block_table: hv(&swa_bt, &[requests, swa_max]),
        page_slots,
    };
    let (out, lse) = host_attention(dev, &b, &mc, &sc, requests)?;
    let (want, want_lse) = attention_ref(
        &q,
        &topk,
        topk_len,
        &pos,
        &reqs,
        &window_start,
        (&main.layout, &mc),
        (&swa.layout, &sc),
        Some(&sink),
        Some(&rope),
        scale,
    );
    rep.stats("output vs f64 reference", &out, &want, &GPU_F32_VS_F64);
    rep.stats("lse vs f64 reference", &lse, &want_lse, &GPU_F32_VS_F64);
    rep.check("no NaN in output", out.iter().all(|v| !v.is_nan()), "");
    // (A sanitizer run checks memory and ordering; the rerun would add time, not evidence.)
    if !sanitized() {
        let (out2, lse2) = host_attention(dev, &b, &mc, &sc, requests)?;
        rep.check(
            "bitwise rerun",
            bits_eq_f32(&out, &out2) && bits_eq_f32(&lse, &lse2),
            "",
        );
    }
    // A fully masked row (no top-k, no window) outputs zeros, lse −Inf.
    let empty_ws = vec![i32::MAX; requests];
    let none = vec![-1i32; requests * topk_len];
    let (o0, l0) = host_attention(
        dev,
        &DecodeBatch {
            topk: hv(&none, &[requests, topk_len]),
            window_start: hv(&empty_ws, &[requests]),
            ..b.clone()
        },
        &mc,
        &sc,
        requests,
    )?;
    rep.check(
        "all-masked rows → zeros, lse −Inf",
        o0.iter().all(|&v| v == 0.0) && l0.iter().all(|&v| v == f32::NEG_INFINITY),
        "",
    );

    if size.iters > 0 {
        // The same call on device-resident tensors (borrowed in place, nothing copied per call).
        let dq = dev.upload(&q)?;
        let dtk = dev.upload(&topk)?;
        let dpos = dev.upload(&pos)?;
        let dreq = dev.upload(&reqs)?;
        let dws = dev.upload(&window_start)?;
        let dmp = dev.upload(&main.bytes)?;
        let dmbt = dev.upload(&main_bt)?;
        let dsp = dev.upload(&swa.bytes)?;
        let dsbt = dev.upload(&swa_bt)?;
        let dsink = dev.upload(&sink)?;
        let mut o = dev.zeros::<f32>(requests * 64 * KV)?;
        let mut l = dev.zeros::<f32>(requests * 64)?;
        // SAFETY: every buffer is a live allocation of this device for the whole block.
        let us = unsafe {
            let db = DecodeBatch {
                q: dev_view(dev, &dq, &[requests, 64, KV]),
                topk: dev_view(dev, &dtk, &[requests, topk_len]),
                pos: dev_view(dev, &dpos, &[requests]),
                req: dev_view(dev, &dreq, &[requests]),
                window_start: dev_view(dev, &dws, &[requests]),
                sink: Some(dev_view(dev, &dsink, &[64])),
                inv_freq: Some(&inv_freq),
                scale,
            };
            let dmc = TablePages {
                pages: dev_view(dev, &dmp, &[main.bytes.len()]),
                block_table: dev_view(dev, &dmbt, &[requests, main_max]),
                page_slots,
            };
            let dsc = TablePages {
                pages: dev_view(dev, &dsp, &[swa.bytes.len()]),
                block_table: dev_view(dev, &dsbt, &[requests, swa_max]),
                page_slots,
            };
            let mut ov = dev_view_mut(dev, &mut o, &[requests, 64, KV]);
            let mut lv = dev_view_mut(dev, &mut l, &[requests, 64]);
            time_us(dev, size.iters, || {
                dev.sparse_decode_attention(&db, &dmc, &dsc, &mut ov, &mut lv)
            })?
        };
        let keys = topk.iter().filter(|&&v| v >= 0).count() * 288 + requests * 128 * 528;
        rep.timing = Some((us, (keys + 2 * requests * 64 * KV * 4) as f64));
    }
    Ok(rep)
}

/// Runs the attention kernel on host tensors; (out (T, 64, 512), lse (T, 64)).
fn host_attention(
    dev: &CudaDevice,
    b: &DecodeBatch,
    main: &TablePages,
    swa: &TablePages,
    t: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut out = vec![0f32; t * 64 * KV];
    let mut lse = vec![0f32; t * 64];
    dev.sparse_decode_attention(
        b,
        main,
        swa,
        &mut TensorViewMut::from_host_slice(&mut out, &[t, 64, KV])?,
        &mut TensorViewMut::from_host_slice(&mut lse, &[t, 64])?,
    )?;
    Ok((out, lse))
}

/// A dense view of a device buffer.
///
/// # Safety
/// `s` must stay allocated (and not be written by others) while the view is used.
unsafe fn dev_view<'a, T: Element>(
    dev: &CudaDevice,
    s: &'a csa2::cuda::DeviceBuffer<T>,
    shape: &[usize],
) -> TensorView<'a> {
    use csa2::cuda::driver::DevicePtr;
    let (p, _sync) = s.device_ptr(dev.stream());
    let strides = csa2::tensor::row_major_strides(shape);
    let ordinal = dev.context().ordinal() as i32;
    // SAFETY: the caller's contract.
    unsafe {
        TensorView::from_raw_parts(
            p as *const u8,
            shape,
            &strides,
            T::DTYPE,
            Device::Cuda(ordinal),
        )
    }
    .unwrap()
}

/// A dense writable view of a device buffer.
///
/// # Safety
/// As [`dev_view`], and nothing else may access `s` while the view is used.
unsafe fn dev_view_mut<'a, T: Element>(
    dev: &CudaDevice,
    s: &'a mut csa2::cuda::DeviceBuffer<T>,
    shape: &[usize],
) -> TensorViewMut<'a> {
    use csa2::cuda::driver::DevicePtrMut;
    let (p, _sync) = s.device_ptr_mut(dev.stream());
    let strides = csa2::tensor::row_major_strides(shape);
    let ordinal = dev.context().ordinal() as i32;
    // SAFETY: the caller's contract.
    unsafe {
        TensorViewMut::from_raw_parts(
            p as *mut u8,
            shape,
            &strides,
            T::DTYPE,
            Device::Cuda(ordinal),
        )
    }
    .unwrap()
}

// ---- 6. mHC ----------------------------------------------------------------------------------------------

pub fn check_mhc(dev: &CudaDevice, with_y: bool, size: Size, seed: u64) -> Result<Report> {
    let mut rep = Report::new(format!(
        "Mega-mHC boundary{}",
        if with_y { "" } else { " (first sublayer)" }
    ));
    let mut rng = StdRng::seed_from_u64(seed);
    let (t, d) = if size.large { (512, 5120) } else { (6, 640) };
    let bfv = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let x = bfv(normal(&mut rng, t * 4 * d, 1.0));
    let y = bfv(normal(&mut rng, t * d, 1.0));
    let post_prev: Vec<f32> = (0..t * 4).map(|_| rng.random_range(0.0..2.0)).collect();
    let comb_prev: Vec<f32> = (0..t * 16).map(|_| rng.random_range(0.0..0.5)).collect();
    let mut pre_c: Vec<f32> = (0..t * 4).map(|_| rng.random_range(0.0..1.0)).collect();
    if !with_y {
        pre_c
            .chunks_mut(4)
            .for_each(|p| p.copy_from_slice(&[1.0, 0.0, 0.0, 0.0]));
    }
    let fn_ = normal(&mut rng, 24 * 4 * d, 0.02);
    let base = normal(&mut rng, 24, 0.5);
    let scale = vec![0.7f32, 1.1, 0.9];
    let norm_w: Vec<f32> = (0..d).map(|_| rng.random_range(0.5..1.5)).collect();
    let p = MhcParams::new(d);
    let mw = MixWeights {
        hc_fn: &fn_,
        base: &base,
        scale: &scale,
        packed: None,
    };
    let y_opt = with_y.then_some(y.as_slice());
    let run = || {
        host::mega_mhc(
            dev, &p, &mw, &norm_w, &x, y_opt, &post_prev, &comb_prev, &pre_c,
        )
    };
    let got = run()?;
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let yf: Vec<f32> = y.iter().map(|v| v.to_f32()).collect();
    let rb = mhc::reference::boundary_rounded(
        &p,
        &mhc::BoundaryIn {
            x: &xf,
            update: with_y.then_some(PostUpdate {
                y: &yf,
                post: &post_prev,
                comb: &comb_prev,
            }),
            pre_prev: &pre_c,
            next: Some(mw),
            norm: &norm_w,
        },
        mhc::reference::Rounding::Bf16,
    )?;
    let (want_pre, want_post, want_comb) = rb.flat_coeffs();
    let f = |v: &[bf16]| v.iter().map(|b| b.to_f32()).collect::<Vec<f32>>();
    rep.stats(
        "new streams X' (bf16)",
        &f(&got.x),
        &rb.x_new,
        &GPU_BF16_VS_F64,
    );
    rep.stats(
        "sublayer input (bf16)",
        &f(&got.x_in),
        &rb.layer_in,
        &GPU_BF16_VS_F64,
    );
    rep.stats("pre", &got.pre, &want_pre, &GPU_F32_VS_F64);
    rep.stats("post", &got.post, &want_post, &GPU_F32_VS_F64);
    rep.stats("comb (Sinkhorn)", &got.comb, &want_comb, &GPU_F32_VS_F64);
    let again = run()?;
    rep.check("bitwise rerun", again == got, "");

    if size.iters > 0 {
        let dx = dev.upload(&x)?;
        let dy = dev.upload(&y)?;
        let dpp = dev.upload(&post_prev)?;
        let dcp = dev.upload(&comb_prev)?;
        let dpc = dev.upload(&pre_c)?;
        let dfn = dev.upload(&fn_)?;
        let db = dev.upload(&base)?;
        let ds = dev.upload(&scale)?;
        let dn = dev.upload(&norm_w)?;
        let mut xo = dev.zeros::<bf16>(t * 4 * d)?;
        let mut pre = dev.zeros::<f32>(t * 4)?;
        let mut post = dev.zeros::<f32>(t * 4)?;
        let mut comb = dev.zeros::<f32>(t * 16)?;
        let mut xin = dev.zeros::<bf16>(t * d)?;
        let a = mhc::cuda::DeviceBoundaryIn {
            x: &dx,
            y: with_y.then_some(&dy),
            post_prev: &dpp,
            comb_prev: &dcp,
            pre_prev: &dpc,
            hc_fn: &dfn,
            base: &db,
            scale: &ds,
            norm: &dn,
            tokens: t,
        };
        let us = time_us(dev, size.iters, || {
            mhc::cuda::boundary(
                dev,
                &p,
                &a,
                mhc::cuda::DeviceBoundaryOut {
                    x_new: &mut xo,
                    layer_in: &mut xin,
                    pre: &mut pre,
                    post: &mut post,
                    comb: &mut comb,
                },
            )
        })?;
        // (2n + 2)·d bf16 per token (the fn matrix is L2-resident and not counted).
        rep.timing = Some((us, (t * (2 * 4 + 2) * d * 2) as f64));
    }
    Ok(rep)
}

/// Every check, in order.
pub fn all(dev: &CudaDevice, size: Size, seed: u64) -> Vec<(String, Result<Report>)> {
    let mut v: Vec<(String, Result<Report>)> = vec![];
    for (i, fmt) in [
        RecordFormat::Nvfp4Ds,
        RecordFormat::Mxfp4Index,
        RecordFormat::Mxfp8,
    ]
    .into_iter()
    .enumerate()
    {
        v.push((
            format!("codec {}", fmt.name()),
            check_codec(dev, fmt, size, seed + i as u64),
        ));
    }
    v.push((
        "compressor r1".into(),
        check_compressor(dev, 1, size, seed + 10),
    ));
    v.push((
        "compressor r2".into(),
        check_compressor(dev, 2, size, seed + 11),
    ));
    v.push((
        "indexer decode".into(),
        check_indexer(dev, false, false, size, seed + 20),
    ));
    v.push((
        "indexer prefill".into(),
        check_indexer(dev, true, false, size, seed + 21),
    ));
    v.push((
        "indexer masked".into(),
        check_indexer(dev, false, true, size, seed + 22),
    ));
    v.push(("topk".into(), check_topk(dev, size, seed + 30)));
    v.push((
        "topk ordered, caller's stream".into(),
        check_topk_ordered(dev, size, seed + 32),
    ));
    v.push((
        "indexer pool (strided slab)".into(),
        check_indexer_pool(dev, size, seed + 22),
    ));
    v.push(("candidates".into(), check_candidates(dev, size, seed + 31)));
    v.push((
        "candidates sorted, caller's stream".into(),
        check_candidates_ordered(dev, size, seed + 33),
    ));
    v.push(("attention".into(), check_attention(dev, size, seed + 40)));
    v.push(("mhc".into(), check_mhc(dev, true, size, seed + 50)));
    v.push(("mhc first".into(), check_mhc(dev, false, size, seed + 51)));
    v
}

// ---- 7. the pooled indexer and the ordered top-k on the caller's stream ---------------------

/// The CUDA stream csa2's device uses, as a caller's raw `CUstream` (the entries borrow it).
fn raw_stream(dev: &CudaDevice) -> u64 {
    dev.stream().cu_stream() as u64
}

/// Captures `call` (given a fresh stream of `dev` as a raw `CUstream`) in a CUDA graph, replays the
/// graph once and waits for it — what vLLM does with a decode step. The call must queue device work
/// only: a capture refuses allocation, host copies, synchronisation and module loads (the emulated
/// device applies the driver's rules), and the capture's error names the first such call.
fn replay_captured(dev: &CudaDevice, call: impl FnOnce(u64) -> Result<()>) -> Result<()> {
    use csa2::cuda::driver::sys::{CUgraphInstantiate_flags as F, CUstreamCaptureMode as M};
    let driver = |op: &str, e: &dyn std::fmt::Display| csa2::Error::Cuda {
        op: op.into(),
        reason: e.to_string(),
    };
    let s = dev
        .context()
        .new_stream()
        .map_err(|e| driver("new stream", &e))?;
    s.begin_capture(M::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .map_err(|e| driver("begin capture", &e))?;
    let called = call(s.cu_stream() as u64);
    let graph = s.end_capture(F::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    called?;
    let graph = graph
        .map_err(|e| driver("end capture", &e))?
        .ok_or_else(|| driver("end capture", &"nothing was captured"))?;
    graph.launch().map_err(|e| driver("graph launch", &e))?;
    s.synchronize()
        .map_err(|e| driver("stream synchronize", &e))
}

/// `csa2::ops::indexer::logits_in_pool_view` on a strided, offset, block-planar MXFP4 index-K slab
/// laid out as vLLM 0.33 does (pages `block_stride` bytes apart, other layers' bytes between them):
/// GPU vs the CPU entry on the same slab and vs the f64 reference, for each query quantisation
/// (each an entry point of its own, also checked bit for bit against the unquantised one on
/// queries quantised on the host); the kernel's error record for a bad block and a negative
/// position; a bitwise rerun captured in a CUDA graph on another stream and replayed.
pub fn check_indexer_pool(dev: &CudaDevice, size: Size, seed: u64) -> Result<Report> {
    use csa2::ops::attention::{PoolDesc, PoolLayout};
    use csa2::ops::indexer::{PoolPlace, PoolQueries, QueryQuant};
    let mut rep = Report::new("indexer logits over a strided vLLM index-K slab (caller's stream)");
    let mut rng = StdRng::seed_from_u64(seed);
    let (states, ratio) = (64usize, 4usize);
    // Under a sanitizer 600 positions (150 entries: two 64-entry pages and part of a third), and
    // the block boundary probed at 256 instead of 2,048.
    let (requests, ctx) = if size.large {
        (8, 131_072usize)
    } else if sanitized() {
        (3, 600)
    } else {
        (3, 3000)
    };
    let edge = if sanitized() { 256 } else { 2048 };
    let entries = ctx / ratio;
    let max_blocks = entries.div_ceil(states);
    let blocks = requests * max_blocks + 3;
    let fmt = RecordFormat::Mxfp4Index;
    // A slab of all layers per block: this pool's page (64 × 68 B) plus 1,000 bytes of others,
    // at an odd offset into the slab.
    let (offset, block_stride) = (1001usize, states * fmt.record_bytes() + 1000);
    let desc = PoolDesc {
        format: fmt,
        layout: PoolLayout::BlockPlanar,
        blocks,
        states_per_page: states,
        block_stride,
    };
    let mut slab = vec![0x7fu8; offset + blocks * block_stride];
    let mut compact = vec![0u8; blocks * states * fmt.record_bytes()];
    for slot in 0..blocks * states {
        let row = normal(&mut rng, IDX, 1.0);
        let (d, s) = desc.offsets(slot);
        let (data, scale) = (fmt.data_bytes(), fmt.scale_bytes());
        let mut rec = vec![0u8; fmt.record_bytes()];
        csa2::formats::encode_rows(fmt, &row, &mut rec)?;
        slab[offset + d..][..data].copy_from_slice(&rec[..data]);
        slab[offset + s..][..scale].copy_from_slice(&rec[data..]);
        // csa2's own dense pages hold the same page bytes back to back (the reference's input).
        let page = slot / states;
        let src = offset + page * block_stride;
        let len = states * fmt.record_bytes();
        compact[page * len..][..len].copy_from_slice(&slab[src..src + len]);
    }
    let bt = block_tables(&mut rng, requests, max_blocks, blocks, true);
    let (mut pos, mut req) = (vec![], vec![]);
    for r in 0..requests {
        for p in [0usize, 3, 4, edge - 1, edge, ctx - 1 - r] {
            pos.push(p.min(ctx - 1) as i64);
            req.push(r as i32);
        }
    }
    let t = pos.len();
    let heads = 32usize;
    let q = normal(&mut rng, t * heads * IDX, 1.0);
    let w: Vec<f32> = normal(&mut rng, t * heads, 1.0)
        .iter()
        .map(|v| v / 64.0)
        .collect();
    let n_cols = entries;
    let qs = IndexerQueries {
        q: &q,
        w: &w,
        positions: &pos,
    };
    let cache = IndexCache {
        pages: &compact,
        block_table: &bt,
        max_blocks,
        page_slots: states,
    };
    let view = csa2::ops::attention::PoolView::new(desc, &slab[offset..], "keys")?;

    let ordinal = dev.context().ordinal() as i32;
    let d_slab = dev.upload(&slab)?;
    let (dq, dw, dp, dr, dbt) = (
        dev.upload(&q)?,
        dev.upload(&w)?,
        dev.upload(&pos)?,
        dev.upload(&req)?,
        dev.upload(&bt)?,
    );
    let mut dout = dev.zeros::<f32>(t * n_cols)?;
    let mut derr = dev.zeros::<i32>(4)?;
    let slab_addr = {
        use csa2::cuda::driver::DevicePtr;
        d_slab.device_ptr(dev.stream()).0 as usize
    };
    let launch = |p: &IndexerParams,
                  q_dev: &csa2::cuda::DeviceBuffer<f32>,
                  bt_dev: &csa2::cuda::DeviceBuffer<i32>,
                  pos_dev: &csa2::cuda::DeviceBuffer<i64>,
                  out: &mut csa2::cuda::DeviceBuffer<f32>,
                  err: &mut csa2::cuda::DeviceBuffer<i32>,
                  stream: u64|
     -> Result<()> {
        // SAFETY: every buffer outlives the views and the launch (synchronized below).
        unsafe {
            let (qv, wv, pv, rv, bv) = (
                dev_view(dev, q_dev, &[t, heads, IDX]),
                dev_view(dev, &dw, &[t, heads]),
                dev_view(dev, pos_dev, &[t]),
                dev_view(dev, &dr, &[t]),
                dev_view(dev, bt_dev, &[requests, max_blocks]),
            );
            let keys = PoolPlace::new(desc, slab_addr + offset, Device::Cuda(ordinal));
            let call = PoolQueries {
                q: &qv,
                w: &wv,
                positions: &pv,
                req: &rv,
                block_table: &bv,
                keys,
            };
            let mut ov = dev_view_mut(dev, out, &[t, n_cols]);
            let mut ev = dev_view_mut(dev, err, &[4]);
            indexer::logits_in_pool_view(p, &call, &mut ov, Some(&mut ev), stream)
        }
    };
    let run = |p: &IndexerParams,
               q_dev: &csa2::cuda::DeviceBuffer<f32>,
               bt_dev: &csa2::cuda::DeviceBuffer<i32>,
               pos_dev: &csa2::cuda::DeviceBuffer<i64>,
               out: &mut csa2::cuda::DeviceBuffer<f32>,
               err: &mut csa2::cuda::DeviceBuffer<i32>|
     -> Result<()> {
        launch(p, q_dev, bt_dev, pos_dev, out, err, raw_stream(dev))?;
        dev.synchronize()
    };
    // Every query quantisation (each its own entry point).
    for quant in [
        QueryQuant::None,
        QueryQuant::Mxfp4,
        QueryQuant::Fp8,
        QueryQuant::Bf16,
    ] {
        let p = IndexerParams {
            ratio,
            heads,
            query_quant: quant,
        };
        run(&p, &dq, &dbt, &dp, &mut dout, &mut derr)?;
        let got = dev.download(&dout)?;
        let mut cpu = vec![0f32; t * n_cols];
        indexer::logits_in_pool(&p, &qs, &req, &view, &bt, max_blocks, n_cols, &mut cpu)?;
        let want = indexer::reference::logits_paged(&p, &qs, &req, &cache, None, n_cols);
        rep.stats(
            &format!("{quant:?}: GPU vs f64 reference"),
            &got,
            &want,
            &GPU_F32_VS_F64,
        );
        rep.stats(
            &format!("{quant:?}: GPU vs the CPU entry on the same slab"),
            &got,
            &cpu,
            &GPU_F32_VS_F64,
        );
        let e = dev.download(&derr)?;
        rep.check(
            &format!("{quant:?}: no error recorded"),
            e == [0; 4],
            format!("{e:?}"),
        );
        if quant == QueryQuant::None {
            // The rerun as a CUDA graph captured on another stream and replayed: no host work in
            // the call, and the same bits.
            dout = dev.zeros::<f32>(t * n_cols)?;
            replay_captured(dev, |s| launch(&p, &dq, &dbt, &dp, &mut dout, &mut derr, s))?;
            rep.check(
                "bitwise rerun, captured in a graph and replayed",
                bits_eq_f32(&dev.download(&dout)?, &got),
                "",
            );
        } else {
            // The kernel's in-lane quantiser is QueryQuant::apply bit for bit: the unquantised
            // kernel on queries quantised on the host gives the same bits.
            let mut qq = q.clone();
            qq.chunks_mut(IDX).for_each(|row| quant.apply(row));
            let dqq = dev.upload(&qq)?;
            let none = IndexerParams {
                query_quant: QueryQuant::None,
                ..p
            };
            run(&none, &dqq, &dbt, &dp, &mut dout, &mut derr)?;
            rep.check(
                &format!("{quant:?}: GPU == the unquantised GPU kernel on host-quantised queries, bit for bit"),
                bits_eq_f32(&dev.download(&dout)?, &got),
                "",
            );
        }
    }
    // Bad input the host never sees: a block past the pool (request 0's first block) and a
    // negative position (row 1). The kernel records the first one and writes −∞ there.
    let mut bad_bt = bt.clone();
    bad_bt[0] = blocks as i32 + 5;
    let mut bad_pos = pos.clone();
    bad_pos[1] = -3;
    let (dbad_bt, dbad_pos) = (dev.upload(&bad_bt)?, dev.upload(&bad_pos)?);
    let p = IndexerParams::new(ratio);
    run(&p, &dq, &dbad_bt, &dbad_pos, &mut dout, &mut derr)?;
    let e = dev.download(&derr)?;
    let got = dev.download(&dout)?;
    rep.check(
        "bad block / position recorded in the error tensor",
        (e[0] == 2 && e[3] == blocks as i32 + 5) || (e[0] == 3 && e[1] == 1 && e[3] == -3),
        format!("{e:?}"),
    );
    rep.check(
        "the negative position's row is all −∞",
        got[n_cols..2 * n_cols]
            .iter()
            .all(|&v| v == f32::NEG_INFINITY),
        "",
    );
    // One dtype contract on both devices: bf16 queries (what the serving shim passes on SM90),
    // f16 weights and bf16 logits, through the same view entry on host and on device memory.
    {
        use half::f16;
        let qb: Vec<bf16> = q.iter().map(|&v| bf16::from_f32(v)).collect();
        let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let p = IndexerParams::new(ratio);
        let mut host_out = vec![bf16::ZERO; t * n_cols];
        {
            let (qv, wv, pv, rv, bv) = (
                TensorView::from_host_slice(&qb, &[t, heads, IDX])?,
                TensorView::from_host_slice(&wh, &[t, heads])?,
                TensorView::from_host_slice(&pos, &[t])?,
                TensorView::from_host_slice(&req, &[t])?,
                TensorView::from_host_slice(&bt, &[requests, max_blocks])?,
            );
            // SAFETY: the slab outlives the call and holds the pool's extent past `offset`.
            let keys =
                unsafe { PoolPlace::new(desc, slab[offset..].as_ptr() as usize, Device::Cpu) };
            let call = PoolQueries {
                q: &qv,
                w: &wv,
                positions: &pv,
                req: &rv,
                block_table: &bv,
                keys,
            };
            let mut ov = TensorViewMut::from_host_slice(&mut host_out, &[t, n_cols])?;
            indexer::logits_in_pool_view(&p, &call, &mut ov, None, 0)?;
        }
        let (dqb, dwh) = (dev.upload(&qb)?, dev.upload(&wh)?);
        let mut dob = dev.zeros::<bf16>(t * n_cols)?;
        let mut z = dev.zeros::<i32>(4)?;
        // SAFETY: every buffer outlives the views and the launch (synchronized below).
        unsafe {
            let (qv, wv, pv, rv, bv) = (
                dev_view(dev, &dqb, &[t, heads, IDX]),
                dev_view(dev, &dwh, &[t, heads]),
                dev_view(dev, &dp, &[t]),
                dev_view(dev, &dr, &[t]),
                dev_view(dev, &dbt, &[requests, max_blocks]),
            );
            let keys = PoolPlace::new(desc, slab_addr + offset, Device::Cuda(ordinal));
            let call = PoolQueries {
                q: &qv,
                w: &wv,
                positions: &pv,
                req: &rv,
                block_table: &bv,
                keys,
            };
            let mut ov = dev_view_mut(dev, &mut dob, &[t, n_cols]);
            let mut ev = dev_view_mut(dev, &mut z, &[4]);
            indexer::logits_in_pool_view(&p, &call, &mut ov, Some(&mut ev), raw_stream(dev))?;
        }
        dev.synchronize()?;
        let got: Vec<f32> = dev.download(&dob)?.iter().map(|v| v.to_f32()).collect();
        let want: Vec<f32> = host_out.iter().map(|v| v.to_f32()).collect();
        rep.stats(
            "bf16 q, f16 w, bf16 logits: GPU vs the CPU entry (one bf16 rounding apart)",
            &got,
            &want,
            &GPU_BF16_VS_F64,
        );
    }
    if size.iters > 0 {
        let mut z = dev.zeros::<i32>(4)?;
        let us = time_us(dev, size.iters, || {
            launch(&p, &dq, &dbt, &dp, &mut dout, &mut z, raw_stream(dev))
        })?;
        let visible: usize = pos
            .iter()
            .map(|&p| ((p as usize + 1) / ratio).min(n_cols))
            .sum();
        rep.timing = Some((us, (visible * (68 + 4) + t * heads * 129 * 4) as f64));
    }
    Ok(rep)
}

/// `csa2::ops::topk::select_rows_view_on_stream` on device tensors (the capture-safe entry: the
/// order comes from the kernel, positions are read on the device) and the synchronous
/// `select_rows_view`: both equal to the CPU entry on the same rows, for k = 512 and 2048, with
/// ties, signed zeros, NaN, −∞ and rows that select everything; counts and the error record of a
/// negative position; the on-stream call captured in a CUDA graph and replayed, equal to eager.
pub fn check_topk_ordered(dev: &CudaDevice, size: Size, seed: u64) -> Result<Report> {
    use csa2::ops::topk::{select_rows_view, select_rows_view_on_stream};
    let mut rep = Report::new("top-k in the order contract on the caller's stream");
    let mut rng = StdRng::seed_from_u64(seed);
    let n = if size.large { 262_144 } else { 6000 };
    let pos: Vec<i64> = vec![
        n as i64 - 1,
        n as i64 + 100,
        5000,
        511,
        512,
        2047,
        2048,
        n as i64 / 2,
        -4,
        0,
    ];
    let t = pos.len();
    let mut logits = vec![0f32; t * n];
    for (r, row) in logits.chunks_mut(n).enumerate() {
        for (i, v) in row.iter_mut().enumerate() {
            *v = match r % 5 {
                0 => rng.random_range(0..4) as f32,
                1 => match i % 9 {
                    0 => -0.0,
                    1 => 0.0,
                    2 => f32::NAN,
                    3 => f32::NEG_INFINITY,
                    _ => rng.random_range(-1.0f32..1.0),
                },
                2 => {
                    if i % 5 == 0 && i < 1500 {
                        StandardNormal.sample(&mut rng)
                    } else {
                        f32::NEG_INFINITY
                    }
                }
                _ => StandardNormal.sample(&mut rng),
            };
        }
    }
    let (dl, dp) = (dev.upload(&logits)?, dev.upload(&pos)?);
    for k in [512usize, 2048] {
        // CPU entry (the negative row is refused there, so it runs on the other rows).
        let ok_rows: Vec<usize> = (0..t).filter(|&r| pos[r] >= 0).collect();
        let mut want = vec![-1i32; t * k];
        let mut want_counts = vec![0i32; t];
        for &r in &ok_rows {
            let lv = TensorView::from_host_slice(&logits[r * n..(r + 1) * n], &[1, n])?;
            let pv = TensorView::from_host_slice(&pos[r..r + 1], &[1])?;
            let (mut o, mut c) = (vec![0i32; k], vec![0i32; 1]);
            let mut ov = TensorViewMut::from_host_slice(&mut o, &[1, k])?;
            let mut cv = TensorViewMut::from_host_slice(&mut c, &[1])?;
            select_rows_view(&lv, &pv, 1, &mut ov, Some(&mut cv))?;
            want[r * k..(r + 1) * k].copy_from_slice(&o);
            want_counts[r] = c[0];
        }
        let mut dout = dev.zeros::<i32>(t * k)?;
        let mut dcnt = dev.zeros::<i32>(t)?;
        let mut derr = dev.zeros::<i32>(4)?;
        // SAFETY: the buffers outlive the views and the launch (synchronized below).
        unsafe {
            let lv = dev_view(dev, &dl, &[t, n]);
            let pv = dev_view(dev, &dp, &[t]);
            let mut ov = dev_view_mut(dev, &mut dout, &[t, k]);
            let mut cv = dev_view_mut(dev, &mut dcnt, &[t]);
            let mut ev = dev_view_mut(dev, &mut derr, &[4]);
            select_rows_view_on_stream(
                &lv,
                &pv,
                1,
                &mut ov,
                Some(&mut cv),
                Some(&mut ev),
                raw_stream(dev),
            )?;
        }
        dev.synchronize()?;
        let (got, counts, e) = (
            dev.download(&dout)?,
            dev.download(&dcnt)?,
            dev.download(&derr)?,
        );
        let bad: Vec<usize> = (0..t)
            .filter(|&r| got[r * k..(r + 1) * k] != want[r * k..(r + 1) * k])
            .collect();
        rep.check(
            &format!("k={k}: on-stream selection and order == CPU"),
            bad.is_empty(),
            format!("rows differing: {bad:?}"),
        );
        rep.check(
            &format!("k={k}: counts == CPU"),
            counts == want_counts,
            format!("{counts:?} vs {want_counts:?}"),
        );
        rep.check(
            &format!("k={k}: negative position recorded"),
            e == [1, 8, 0, -4],
            format!("{e:?}"),
        );
        // The same call captured in a CUDA graph on another stream and replayed.
        let (mut gout, mut gcnt) = (dev.zeros::<i32>(t * k)?, dev.zeros::<i32>(t)?);
        replay_captured(dev, |s| {
            // SAFETY: as above; the graph is replayed and waited for before the views drop.
            unsafe {
                let lv = dev_view(dev, &dl, &[t, n]);
                let pv = dev_view(dev, &dp, &[t]);
                let mut ov = dev_view_mut(dev, &mut gout, &[t, k]);
                let mut cv = dev_view_mut(dev, &mut gcnt, &[t]);
                select_rows_view_on_stream(&lv, &pv, 1, &mut ov, Some(&mut cv), None, s)
            }
        })?;
        rep.check(
            &format!("k={k}: captured in a graph and replayed == eager"),
            dev.download(&gout)? == got && dev.download(&gcnt)? == counts,
            "",
        );
        // The synchronous entry (csa2_topk's) on the rows it accepts.
        let sel: Vec<usize> = ok_rows.clone();
        let sub_l: Vec<f32> = sel
            .iter()
            .flat_map(|&r| logits[r * n..(r + 1) * n].iter().copied())
            .collect();
        let sub_p: Vec<i64> = sel.iter().map(|&r| pos[r]).collect();
        let (dsl, dsp) = (dev.upload(&sub_l)?, dev.upload(&sub_p)?);
        let mut dso = dev.zeros::<i32>(sel.len() * k)?;
        // SAFETY: as above; the entry synchronizes before it returns.
        unsafe {
            let lv = dev_view(dev, &dsl, &[sel.len(), n]);
            let pv = dev_view(dev, &dsp, &[sel.len()]);
            let mut ov = dev_view_mut(dev, &mut dso, &[sel.len(), k]);
            select_rows_view(&lv, &pv, 1, &mut ov, None)?;
        }
        let sync_got = dev.download(&dso)?;
        let sync_want: Vec<i32> = sel
            .iter()
            .flat_map(|&r| want[r * k..(r + 1) * k].iter().copied())
            .collect();
        rep.check(
            &format!("k={k}: synchronous entry == CPU"),
            sync_got == sync_want,
            "",
        );
    }
    if size.iters > 0 {
        let k = 512;
        let mut dout = dev.zeros::<i32>(t * k)?;
        let us = time_us(dev, size.iters, || {
            // SAFETY: as above.
            unsafe {
                let lv = dev_view(dev, &dl, &[t, n]);
                let pv = dev_view(dev, &dp, &[t]);
                let mut ov = dev_view_mut(dev, &mut dout, &[t, k]);
                select_rows_view_on_stream(&lv, &pv, 1, &mut ov, None, None, raw_stream(dev))
            }
        })?;
        let read: usize = pos
            .iter()
            .map(|&p| ((p.max(-1) + 1) as usize).min(n) * 4 * 5)
            .sum();
        rep.timing = Some((us, read as f64));
        rep.detail.push_str(
            "note: bytes = 5 passes over the visible keys (4 radix passes + compaction)\n",
        );
    }
    Ok(rep)
}

// ---- 8. the candidate pool's sorted block lists on the caller's stream ---------------------

/// `csa2::ops::candidates::select_blocks_view_on_stream` (the capture-safe entry: block scores,
/// pin, selection and the sort all in `candidate_blocks_f32`, positions read on the device) and
/// the synchronous `select_blocks_view` on device tensors: equal to the CPU entry and to
/// `ops::candidates::reference` (lists, order, −1 padding, counts) for block sizes 1, 4, 8, 16
/// and B from 1 to 4096 (the in-kernel sort's capacity; 4097 is refused), over rows with nothing
/// visible, every block −∞ or NaN (only the pinned block kept), +∞ logits tying the pin, ties,
/// signed zeros, and visible counts around the block size, the ratio, 64-state page boundaries
/// and `block_size · B`; int32 and int64 positions; the error record of a negative position; a
/// bitwise rerun captured in a CUDA graph on another stream and replayed.
pub fn check_candidates_ordered(dev: &CudaDevice, size: Size, seed: u64) -> Result<Report> {
    use csa2::ops::candidates::{select_blocks_view, select_blocks_view_on_stream};
    let mut rep = Report::new("candidate blocks sorted in the kernel (caller's stream)");
    let mut rng = StdRng::seed_from_u64(seed);
    let ratio = 4usize;
    let n = if size.large { 262_144 } else { 40_000 };
    let configs: [(usize, usize, bool); 7] = [
        (8, 2048, true),
        (8, 4096, false),
        (8, 1, true),
        (4, 64, false),
        (16, 300, true),
        (1, 4096, false),
        (8, 7, true),
    ];
    for (ci, &(bs, b, pos_i64)) in configs.iter().enumerate() {
        let p = CandidateParams {
            block_size: bs,
            num_blocks: b,
        };
        let cap = bs * b;
        let mut vis: Vec<i64> = vec![0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 129];
        vis.extend([cap as i64 - 1, cap as i64, cap as i64 + 1]);
        vis.extend([n as i64 - 1, n as i64, n as i64 + 100, 5000, 20_001]);
        // Position p sees (p + 1) div 4 entries: every remainder of the ratio appears.
        let mut pos: Vec<i64> = vis
            .iter()
            .enumerate()
            .map(|(r, &v)| {
                if v == 0 {
                    r as i64 % 3
                } else {
                    4 * v - 1 + r as i64 % 4
                }
            })
            .collect();
        let neg_row = 5;
        pos[neg_row] = -5;
        let t = pos.len();
        let mut logits = vec![0f32; t * n];
        for (r, row) in logits.chunks_mut(n).enumerate() {
            for (i, v) in row.iter_mut().enumerate() {
                *v = match (r + ci) % 7 {
                    0 => rng.random_range(0..4) as f32,
                    1 => match i % 11 {
                        0 => -0.0,
                        1 => 0.0,
                        2 => f32::NAN,
                        3 => f32::NEG_INFINITY,
                        _ => rng.random_range(-1.0f32..1.0),
                    },
                    2 => f32::NEG_INFINITY,
                    3 => {
                        if i % 97 == 0 {
                            StandardNormal.sample(&mut rng)
                        } else {
                            f32::NEG_INFINITY
                        }
                    }
                    4 => f32::NAN,
                    5 => {
                        if i % 501 == 3 {
                            f32::INFINITY
                        } else {
                            StandardNormal.sample(&mut rng)
                        }
                    }
                    _ => StandardNormal.sample(&mut rng),
                };
            }
        }
        // The CPU entry over the rows it accepts (it refuses a negative position outright); the
        // negative row keeps nothing on the GPU.
        let ok_rows: Vec<usize> = (0..t).filter(|&r| pos[r] >= 0).collect();
        let sub_l: Vec<f32> = ok_rows
            .iter()
            .flat_map(|&r| logits[r * n..(r + 1) * n].iter().copied())
            .collect();
        let sub_p: Vec<i64> = ok_rows.iter().map(|&r| pos[r]).collect();
        let m = ok_rows.len();
        let (mut cpu, mut cpu_c) = (vec![0i32; m * b], vec![0i32; m]);
        {
            let lv = TensorView::from_host_slice(&sub_l, &[m, n])?;
            let pv = TensorView::from_host_slice(&sub_p, &[m])?;
            let mut ov = TensorViewMut::from_host_slice(&mut cpu, &[m, b])?;
            let mut cv = TensorViewMut::from_host_slice(&mut cpu_c, &[m])?;
            select_blocks_view(&p, &lv, &pv, ratio, &mut ov, Some(&mut cv))?;
        }
        let (mut want, mut want_c) = (vec![-1i32; t * b], vec![0i32; t]);
        let mut ref_bad = vec![];
        for (j, &r) in ok_rows.iter().enumerate() {
            let row = &cpu[j * b..(j + 1) * b];
            want[r * b..(r + 1) * b].copy_from_slice(row);
            want_c[r] = cpu_c[j];
            let visible = ((pos[r] + 1) as usize / ratio).min(n);
            if candidates_ref::select_blocks(&p, &logits[r * n..(r + 1) * n], visible) != row {
                ref_bad.push(r);
            }
        }
        let tag = format!("bs={bs} B={b}");
        rep.check(
            &format!("{tag}: CPU entry == reference"),
            ref_bad.is_empty(),
            format!("rows differing: {ref_bad:?}"),
        );
        let dl = dev.upload(&logits)?;
        let pos32: Vec<i32> = pos.iter().map(|&v| v as i32).collect();
        let (dp64, dp32) = (dev.upload(&pos)?, dev.upload(&pos32)?);
        let mut runs = vec![];
        // The first run eager on csa2's stream, the second captured in a CUDA graph on another
        // stream and replayed.
        for captured in [false, true] {
            let mut dout = dev.upload(&vec![77i32; t * b])?;
            let mut dcnt = dev.upload(&vec![77i32; t])?;
            let mut derr = dev.zeros::<i32>(4)?;
            let mut call = |s: u64| {
                // SAFETY: the buffers outlive the views and the launch (synchronized below).
                unsafe {
                    let lv = dev_view(dev, &dl, &[t, n]);
                    let pv = if pos_i64 {
                        dev_view(dev, &dp64, &[t])
                    } else {
                        dev_view(dev, &dp32, &[t])
                    };
                    let mut ov = dev_view_mut(dev, &mut dout, &[t, b]);
                    let mut cv = dev_view_mut(dev, &mut dcnt, &[t]);
                    let mut ev = dev_view_mut(dev, &mut derr, &[4]);
                    select_blocks_view_on_stream(
                        &p,
                        &lv,
                        &pv,
                        ratio,
                        &mut ov,
                        Some(&mut cv),
                        Some(&mut ev),
                        s,
                    )
                }
            };
            if captured {
                replay_captured(dev, call)?;
            } else {
                call(raw_stream(dev))?;
                dev.synchronize()?;
            }
            runs.push((
                dev.download(&dout)?,
                dev.download(&dcnt)?,
                dev.download(&derr)?,
            ));
        }
        let (got, counts, e) = &runs[0];
        let bad: Vec<usize> = (0..t)
            .filter(|&r| got[r * b..(r + 1) * b] != want[r * b..(r + 1) * b])
            .collect();
        rep.check(
            &format!("{tag}: on-stream lists and order == CPU"),
            bad.is_empty(),
            format!("rows differing: {bad:?}"),
        );
        rep.check(
            &format!("{tag}: counts == CPU"),
            *counts == want_c,
            format!("{counts:?} vs {want_c:?}"),
        );
        rep.check(
            &format!("{tag}: negative position recorded"),
            *e == [1, neg_row as i32, 0, -5],
            format!("{e:?}"),
        );
        rep.check(
            &format!("{tag}: rerun captured in a graph and replayed, bitwise identical"),
            runs[0] == runs[1],
            "",
        );
        // The synchronous entry (csa2_candidates') on the rows it accepts.
        let (dsl, dsp) = (dev.upload(&sub_l)?, dev.upload(&sub_p)?);
        let mut dso = dev.zeros::<i32>(m * b)?;
        // SAFETY: as above; the entry synchronizes before it returns.
        unsafe {
            let lv = dev_view(dev, &dsl, &[m, n]);
            let pv = dev_view(dev, &dsp, &[m]);
            let mut ov = dev_view_mut(dev, &mut dso, &[m, b]);
            select_blocks_view(&p, &lv, &pv, ratio, &mut ov, None)?;
        }
        rep.check(
            &format!("{tag}: synchronous entry == CPU"),
            dev.download(&dso)? == cpu,
            "",
        );
    }
    // More kept blocks than the in-kernel sort holds: refused before any launch.
    {
        let b = csa2::cuda::shapes::TOPK_SORT_MAX + 1;
        let p = CandidateParams {
            block_size: 8,
            num_blocks: b,
        };
        let (dl, dp) = (dev.zeros::<f32>(2 * 16)?, dev.zeros::<i64>(2)?);
        let mut dout = dev.zeros::<i32>(2 * b)?;
        // SAFETY: never launched (refused first); the buffers outlive the views.
        let r = unsafe {
            let lv = dev_view(dev, &dl, &[2, 16]);
            let pv = dev_view(dev, &dp, &[2]);
            let mut ov = dev_view_mut(dev, &mut dout, &[2, b]);
            select_blocks_view_on_stream(&p, &lv, &pv, 1, &mut ov, None, None, raw_stream(dev))
        };
        rep.check(
            "B over the sort capacity is Unsupported",
            matches!(r, Err(csa2::Error::Unsupported(_))),
            format!("{r:?}"),
        );
    }
    if size.iters > 0 {
        let p = CandidateParams::default();
        let t = 16usize;
        let logits = normal(&mut rng, t * n, 1.0);
        let pos: Vec<i64> = (0..t).map(|r| (4 * n - 1 - r * 997) as i64).collect();
        let (dl, dp) = (dev.upload(&logits)?, dev.upload(&pos)?);
        let mut dout = dev.zeros::<i32>(t * p.num_blocks)?;
        let us = time_us(dev, size.iters, || {
            // SAFETY: as above.
            unsafe {
                let lv = dev_view(dev, &dl, &[t, n]);
                let pv = dev_view(dev, &dp, &[t]);
                let mut ov = dev_view_mut(dev, &mut dout, &[t, p.num_blocks]);
                select_blocks_view_on_stream(&p, &lv, &pv, 4, &mut ov, None, None, raw_stream(dev))
            }
        })?;
        rep.timing = Some((us, (t * n * 4 * 5) as f64));
        rep.detail.push_str(
            "note: bytes = 5 passes over the visible logits (4 radix passes + compaction)\n",
        );
    }
    Ok(rep)
}
