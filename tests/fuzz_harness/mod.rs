//! The C ABI boundary fuzzing harness, shared by `tests/ffi_fuzz.rs` (seeded runs and corpus
//! replays under `cargo test`) and the cargo-fuzz target `fuzz/fuzz_targets/c_abi.rs`
//! (coverage-guided by libFuzzer). It covers the stateless ops
//! (`src/ffi/ops.rs`, first seed family) and the stateful and record-level exports (the
//! candidate-restricted indexer, the compressor state handle, cache entry / SWA / compressor-slot
//! access of `src/ffi/records.rs`; second family, seeds with bit 62 set), whose extra mutations
//! are null handles and unregistered requests; third family, seeds with bit 61 set: exports added
//! after the corpora were recorded (`csa2_attention_indexed`), so that adding one never changes
//! the cases the recorded seeds generate. Of every 15 executions, 14 alternate the first two
//! families and one runs the third.
//!
//! Each case starts from a *valid* argument set for one export (checked to return `CSA2_OK`), then
//! applies 0–3 mutations: null descriptors, bad `ndim`, negative / huge / overflowing shapes, unknown
//! or multi-lane dtypes, foreign devices, non-row-major strides, misaligned or wrapping
//! `byte_offset`, null data, outputs aliasing other arguments, extreme scalars, NaN and
//! out-of-range contents. Invariants checked on every call:
//! - no panic escapes (an unwinding `extern "C"` aborts this process) and none is caught either
//!   (`CSA2_ERR_PANIC` would mean a bug reached the boundary);
//! - a mutation that is invalid by itself yields a non-OK status; an unmutated case yields OK;
//! - the last error is set exactly when the status is not OK.
//!
//! Memory safety of the harness itself: every non-null data pointer is backed by at least the bytes
//! its descriptor claims (claims above 16 MiB get null data instead), and byte offsets are either
//! small (backed) or wrap the address space (refused before any read).
//!
//! In `tests/ffi_fuzz.rs`, `CSA2_FUZZ_ITERS` (default 100000, 14.5 s measured on the 2-core CI
//! machine) sets the number of executions, `CSA2_FUZZ_SEED` the first execution index;
//! `CSA2_FUZZ_SAVE=1` writes the first refused single-mutation case of every (export, mutation kind)
//! to `tests/fuzz_corpus/`, which `corpus_replays` re-runs and checks status for status.

// Handle misuse and concurrent calls (C ABI finding 7) are driven by `lifecycle.rs`, which
// shares only `Source` with the families above, so no recorded case drifts.
//
// Each includer (the test and the fuzz target) uses its own subset.
#![allow(dead_code)]

pub mod lifecycle;

use csa2::ffi::dlpack::{DLDataType, DLDevice, DLTensor, K_DL_CPU};
use csa2::ffi::*;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use std::ffi::c_void;
use std::path::PathBuf;

/// Where a case's random choices come from: a seeded generator (the harness's own runs and the
/// seed corpus) or a fuzzer's input bytes (cargo-fuzz, `fuzz/fuzz_targets/c_abi.rs`).
pub enum Source<'a> {
    /// Deterministic from a seed (boxed: `StdRng` is large beside a slice).
    Seeded(Box<StdRng>),
    /// The bytes left of a fuzzer input; reads past the end give zeros.
    Bytes(&'a [u8]),
}

impl RngCore for Source<'_> {
    fn next_u32(&mut self) -> u32 {
        let mut b = [0; 4];
        self.fill_bytes(&mut b);
        u32::from_le_bytes(b)
    }
    fn next_u64(&mut self) -> u64 {
        let mut b = [0; 8];
        self.fill_bytes(&mut b);
        u64::from_le_bytes(b)
    }
    fn fill_bytes(&mut self, dst: &mut [u8]) {
        match self {
            Source::Seeded(r) => r.fill_bytes(dst),
            Source::Bytes(rest) => {
                let n = dst.len().min(rest.len());
                dst[..n].copy_from_slice(&rest[..n]);
                dst[n..].fill(0);
                *rest = &rest[n..];
            }
        }
    }
}

const CAP_BYTES: u128 = 16 << 20;
pub const EXPORTS: [&str; 15] = [
    "rope",
    "compress",
    "indexer_logits",
    "topk",
    "candidates",
    "attention",
    "mhc",
    // The second family (seeds with FAMILY2 set): the stateful and record-level exports.
    "indexer_in_blocks",
    "compress_step",
    "cache_write",
    "cache_read",
    "swa_write",
    "swa_read",
    "compressor_slot",
    // The third family (seeds with FAMILY3 set): ops added after both corpora were recorded.
    "attention_indexed",
];
/// Exports of the first family (the stateless ops); the second family starts here.
const FAMILY1: usize = 7;
/// First export of the third family (the second family ends here).
const FAMILY3_START: usize = 14;
/// Seed bit that selects the second family, so the first family's seeds (and its corpus) keep
/// generating exactly the cases they always did.
pub const FAMILY2: u64 = 1 << 62;
/// Seed bit that selects the third family, for the same reason: a new export joins a family of its
/// own, so the recorded cases of the first two never drift.
pub const FAMILY3: u64 = 1 << 61;
/// Byte 0 of a fuzzer input selects the third family when `flags & FAMILY3_MASK == FAMILY3_BITS`:
/// a pattern no input of the recorded libFuzzer corpus has, so those inputs keep their family.
const FAMILY3_MASK: u8 = 0x3C;
const FAMILY3_BITS: u8 = 0x0C;
/// Request id every cache case registers (and frees again before returning).
const REQ: u64 = 1;
/// Mutation kinds: 0–12 act on descriptors, scalars and contents (both families); 13 on handles and
/// requests (second family only).
const KINDS1: usize = 13;
const KINDS2: usize = 14;

#[derive(Clone)]
enum Content {
    F32(Vec<f32>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

impl Content {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Content::F32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Content::I32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Content::I64(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Content::U8(v) => v.clone(),
        }
    }
}

/// One tensor argument: descriptor fields plus the memory behind it.
#[derive(Clone)]
pub struct Arg {
    name: &'static str,
    output: bool,
    optional: bool,
    present: bool,
    null_desc: bool,
    ndim: i32,
    shape: [i64; 8],
    strides: Option<[i64; 8]>,
    dtype: DLDataType,
    device: DLDevice,
    byte_offset: u64,
    null_data: bool,
    content: Content,
    /// Index of the argument whose memory this one uses (output aliasing).
    alias_of: Option<usize>,
    buf: Vec<u64>,
    desc: DLTensor,
}

fn dt(code: u8, bits: u8) -> DLDataType {
    DLDataType {
        code,
        bits,
        lanes: 1,
    }
}

fn arg(name: &'static str, shape: &[usize], content: Content) -> Arg {
    let dtype = match &content {
        Content::F32(_) => dt(2, 32),
        Content::I32(_) => dt(0, 32),
        Content::I64(_) => dt(0, 64),
        Content::U8(_) => dt(1, 8),
    };
    let mut s = [0i64; 8];
    for (d, &v) in s.iter_mut().zip(shape) {
        *d = v as i64;
    }
    Arg {
        name,
        output: false,
        optional: false,
        present: true,
        null_desc: false,
        ndim: shape.len() as i32,
        shape: s,
        strides: None,
        dtype,
        device: DLDevice {
            device_type: K_DL_CPU,
            device_id: 0,
        },
        byte_offset: 0,
        null_data: false,
        content,
        alias_of: None,
        buf: Vec::new(),
        desc: DLTensor {
            data: std::ptr::null_mut(),
            device: DLDevice {
                device_type: K_DL_CPU,
                device_id: 0,
            },
            ndim: 0,
            dtype: dt(2, 32),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
    }
}

fn out(mut a: Arg) -> Arg {
    a.output = true;
    a
}
fn opt(mut a: Arg, present: bool) -> Arg {
    a.optional = true;
    a.present = present;
    a
}

fn randn(r: &mut Source<'_>, n: usize, scale: f32) -> Content {
    Content::F32((0..n).map(|_| r.random_range(-scale..scale)).collect())
}

impl Arg {
    /// Bytes the descriptor claims, if `ndim` is in range (None when it overflows).
    fn claimed(&self) -> Option<u128> {
        if !(0..=8).contains(&self.ndim) {
            return Some(0);
        }
        let elem = (self.dtype.bits as u128 * self.dtype.lanes as u128).div_ceil(8);
        let mut n: u128 = 1;
        for &d in &self.shape[..self.ndim as usize] {
            n = n.checked_mul(d.max(0) as u128)?;
        }
        n.checked_mul(elem)
    }
    fn numel_positive(&self) -> bool {
        (0..=8).contains(&self.ndim) && self.shape[..self.ndim as usize].iter().all(|&d| d != 0)
    }
    /// Allocates memory for the claimed bytes and points the descriptor at it.
    fn materialize(&mut self) {
        let claimed = self.claimed();
        let need = match claimed {
            Some(b) if b <= CAP_BYTES => b as usize,
            _ => {
                self.null_data = true;
                0
            }
        };
        let small_off = if self.byte_offset <= 64 {
            self.byte_offset as usize
        } else {
            0
        };
        self.buf = vec![0u64; (need + small_off).div_ceil(8) + 1];
        let bytes = self.content.bytes();
        // SAFETY: the buffer holds at least `need + small_off` bytes; we copy at most `need`.
        unsafe {
            let dst = (self.buf.as_mut_ptr() as *mut u8).add(small_off);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len().min(need));
        }
    }
    fn fix_pointers(&mut self, data: *mut c_void) {
        self.desc = DLTensor {
            data: if self.null_data {
                std::ptr::null_mut()
            } else {
                data
            },
            device: self.device,
            ndim: self.ndim,
            dtype: self.dtype,
            shape: self.shape.as_mut_ptr(),
            strides: self
                .strides
                .as_mut()
                .map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()),
            byte_offset: self.byte_offset,
        };
    }
    fn ptr(&self) -> *const DLTensor {
        if !self.present || self.null_desc {
            std::ptr::null()
        } else {
            &self.desc
        }
    }
}

pub struct Case {
    pub export: usize,
    pub args: Vec<Arg>,
    pub scalars: Vec<i64>,
    pub mhc_params: Option<Csa2MhcParams>,
    pub mutations: Vec<String>,
    pub kinds: Vec<usize>,
    pub must_fail: bool,
    /// Second family: pass a null handle (cache or compressor state).
    pub null_handle: bool,
    /// Second family: do not register the request (every cache call must then fail).
    pub no_request: bool,
}

fn geometry() -> *mut Csa2Geometry {
    let mut g = std::ptr::null_mut();
    assert_eq!(
        unsafe { csa2_geometry_embedded(&mut g) },
        Csa2Status::Csa2Ok
    );
    g
}

fn layers(g: *const Csa2Geometry) -> Vec<(u32, u32)> {
    let mut n = 0usize;
    unsafe { csa2_geometry_num_layers(g, &mut n) };
    (0..n as u32)
        .map(|l| {
            let mut info = std::mem::MaybeUninit::<Csa2LayerInfo>::uninit();
            assert_eq!(
                unsafe { csa2_geometry_layer(g, l as usize, info.as_mut_ptr()) },
                Csa2Status::Csa2Ok
            );
            (l, unsafe { info.assume_init() }.ratio)
        })
        .collect()
}

fn positions(r: &mut Source<'_>, t: usize, below: usize) -> Content {
    Content::I64(
        (0..t)
            .map(|_| r.random_range(0..below.max(1)) as i64)
            .collect(),
    )
}

/// `n` random records of `rec` bytes whose scales (and MXFP8 data) never encode NaN.
fn records(r: &mut Source<'_>, n: usize, rec: usize) -> Vec<u8> {
    let mut b = vec![0u8; n * rec];
    for row in b.chunks_mut(rec.max(1)) {
        match rec {
            288 => {
                row[..256].iter_mut().for_each(|v| *v = r.random());
                row[256..]
                    .iter_mut()
                    .for_each(|v| *v = r.random_range(0x20..0x40));
            }
            68 => {
                row[..64].iter_mut().for_each(|v| *v = r.random());
                row[64..]
                    .iter_mut()
                    .for_each(|v| *v = r.random_range(120..134));
            }
            _ => {
                // MXFP8: E4M3 data without the NaN codes (0x7F, 0xFF), UE8M0 scales near 1.
                let (data, scales) = row.split_at_mut(rec - 16);
                data.iter_mut()
                    .for_each(|v| *v = r.random_range(0..0x7Eu8) | (r.random::<u8>() & 0x80));
                scales
                    .iter_mut()
                    .for_each(|v| *v = r.random_range(120..134));
            }
        }
    }
    b
}

/// What every case shares: the geometry, its layer plan, a weight pool, and one cache whose block
/// for `key` is published (read-only) and cached. Each cache case registers request [`REQ`] and
/// frees it again, so cases do not depend on each other.
pub struct Ctx {
    g: *mut Csa2Geometry,
    plan: Vec<(u32, u32)>,
    wk: Vec<f32>,
    cache: *mut Csa2Cache,
    sources: Vec<u32>,
    key: [u8; 32],
}

impl Ctx {
    pub fn new() -> Ctx {
        let g = geometry();
        let plan = layers(g);
        let mut cache = std::ptr::null_mut();
        let mut key = [0u8; 32];
        let mut n = 0usize;
        let tokens: Vec<u32> = (0..256).collect();
        unsafe {
            assert_eq!(
                csa2_cache_create(
                    &csa2::ffi::Csa2CacheCreateArgs {
                        geometry: g,
                        layout: 0,
                        num_blocks: 64,
                        block_tokens: 256,
                        model: std::ptr::null(),
                        model_len: 0,
                        ..Default::default()
                    },
                    &mut cache
                ),
                Csa2Status::Csa2Ok
            );
            assert_eq!(csa2_cache_add_request(cache, 99), Csa2Status::Csa2Ok);
            assert_eq!(csa2_cache_allocate(cache, 99, 256), Csa2Status::Csa2Ok);
            assert_eq!(
                csa2_cache_prefix_keys(cache, tokens.as_ptr(), 256, key.as_mut_ptr(), 1, &mut n),
                Csa2Status::Csa2Ok
            );
            assert_eq!(
                csa2_cache_publish(cache, 99, key.as_ptr(), 1, &mut n),
                Csa2Status::Csa2Ok
            );
            assert_eq!(csa2_cache_free_request(cache, 99), Csa2Status::Csa2Ok);
        }
        let sources = plan
            .iter()
            .filter(|p| {
                let mut i = Csa2CacheLayerInfo::default();
                unsafe { csa2_cache_layer_info(cache, p.0, &mut i) };
                i.kv_source == 1
            })
            .map(|p| p.0)
            .collect();
        Ctx {
            g,
            plan,
            wk: wk_pool(),
            cache,
            sources,
            key,
        }
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        unsafe {
            csa2_cache_free(self.cache);
            csa2_geometry_free(self.g);
        }
    }
}

/// A valid argument set for `export`.
fn template(r: &mut Source<'_>, export: usize, x: &Ctx) -> Case {
    let (plan, wk) = (&x.plan[..], &x.wk[..]);
    let t = r.random_range(0..4usize);
    let mut scalars = Vec::new();
    let mut mhc_params = None;
    let args = match EXPORTS[export] {
        "rope" => {
            let (h, d) = (r.random_range(1..3), [64, 128][r.random_range(0..2)]);
            scalars = vec![r.random_range(0..plan.len()) as i64, r.random_range(0..2)];
            vec![
                out(arg("x", &[t, h, d], randn(r, t * h * d, 2.0))),
                arg("positions", &[t], positions(r, t, 5000)),
            ]
        }
        "compress" => {
            let full: Vec<_> = plan.iter().filter(|p| p.1 == 1 || p.1 == 2).collect();
            let (layer, m) = *full[r.random_range(0..full.len())];
            let m = m as usize;
            let e = r.random_range(0..3usize);
            let t = e * m;
            scalars = vec![layer as i64, (m * r.random_range(0..100)) as i64];
            vec![
                arg("kv", &[t, 512], randn(r, t * 512, 1.0)),
                opt(arg("score", &[t, 512], randn(r, t * 512, 1.0)), m == 2),
                arg("norm", &[512], Content::F32(vec![1.0; 512])),
                arg("wk", &[128, 512], Content::F32(wk.to_vec())),
                arg("k_norm", &[128], Content::F32(vec![1.0; 128])),
                out(arg("main_kv_out", &[e, 288], Content::U8(vec![]))),
                out(arg("index_k_out", &[e, 68], Content::U8(vec![]))),
            ]
        }
        "indexer_logits" => {
            let (h, n, m) = (
                r.random_range(1..5usize),
                r.random_range(1..9usize),
                r.random_range(1..3usize),
            );
            scalars = vec![m as i64, r.random_range(0..3)];
            let keys = if r.random_bool(0.5) {
                arg("keys", &[n, 128], randn(r, n * 128, 1.0))
            } else {
                let mut b: Vec<u8> = (0..n * 68).map(|_| r.random()).collect();
                // Keep the UE8M0 scales finite (0xFF is NaN), so valid cases stay NaN-free.
                for row in b.chunks_mut(68) {
                    row[64..].iter_mut().for_each(|s| *s = 120 + (*s % 14));
                }
                arg("keys", &[n, 68], Content::U8(b))
            };
            vec![
                arg("q", &[t, h, 128], randn(r, t * h * 128, 1.0)),
                arg("w", &[t, h], randn(r, t * h, 1.0)),
                arg("positions", &[t], positions(r, t, n * m)),
                keys,
                out(arg("logits_out", &[t, n], Content::F32(vec![]))),
            ]
        }
        "topk" | "candidates" => {
            let (n, m, k) = (
                r.random_range(0..20usize),
                r.random_range(1..3usize),
                r.random_range(1..6usize),
            );
            scalars = vec![m as i64, r.random_range(1..5)];
            let mut v = vec![
                arg("logits", &[t, n], randn(r, t * n, 1.0)),
                arg("positions", &[t], positions(r, t, 40)),
                out(arg("out", &[t, k], Content::I32(vec![]))),
            ];
            if EXPORTS[export] == "topk" {
                v.push(out(opt(
                    arg("counts_out", &[t], Content::I32(vec![])),
                    r.random_bool(0.5),
                )));
            }
            v
        }
        "attention" => {
            let (h, n, s, k) = (
                r.random_range(1..3usize),
                r.random_range(0..5usize),
                r.random_range(1..7usize),
                r.random_range(1..4usize),
            );
            scalars = vec![
                0, // main_format (nvfp4 when main is uint8)
                2, // swa_format (mxfp8 when swa is uint8)
                r.random_range(1..9),
                0,
                [0i64, 0.05f32.to_bits() as i64][r.random_range(0..2)],
            ];
            let main = if r.random_bool(0.5) {
                arg("main_kv", &[n, 512], randn(r, n * 512, 1.0))
            } else {
                let mut b = vec![0u8; n * 288];
                // E2M1 data random, E4M3 scales small positive (no NaN encodings).
                for row in b.chunks_mut(288) {
                    row[..256].iter_mut().for_each(|x| *x = r.random());
                    row[256..]
                        .iter_mut()
                        .for_each(|x| *x = r.random_range(0x20..0x40));
                }
                arg("main_kv", &[n, 288], Content::U8(b))
            };
            let topk: Vec<i32> = (0..t * k).map(|_| r.random_range(-1..n as i32)).collect();
            vec![
                arg("q", &[t, h, 512], randn(r, t * h * 512, 1.0)),
                main,
                arg("swa", &[s, 512], randn(r, s * 512, 1.0)),
                arg("topk", &[t, k], Content::I32(topk)),
                opt(
                    arg(
                        "topk_len",
                        &[t],
                        Content::I32((0..t).map(|_| r.random_range(0..=k as i32)).collect()),
                    ),
                    r.random_bool(0.5),
                ),
                arg("positions", &[t], positions(r, t, s)),
                opt(
                    arg(
                        "replay_start",
                        &[1],
                        Content::I64(vec![r.random_range(0..3)]),
                    ),
                    r.random_bool(0.5),
                ),
                arg("sink", &[h], randn(r, h, 1.0)),
                out(arg("out", &[t, h, 512], Content::F32(vec![]))),
                out(arg("lse", &[t, h], Content::F32(vec![]))),
            ]
        }
        "attention_indexed" => {
            let (h, n, s, km, ks) = (
                r.random_range(1..3usize),
                r.random_range(0..5usize),
                r.random_range(0..7usize),
                r.random_range(0..4usize),
                r.random_range(0..5usize),
            );
            scalars = vec![
                0, // main_format (nvfp4 when main is uint8)
                2, // swa_format (mxfp8 when swa is uint8)
                [0i64, 0.05f32.to_bits() as i64][r.random_range(0..2)],
            ];
            let main = if r.random_bool(0.5) {
                arg("main_kv", &[n, 512], randn(r, n * 512, 1.0))
            } else {
                arg("main_kv", &[n, 288], Content::U8(records(r, n, 288)))
            };
            let swa = if r.random_bool(0.5) {
                arg("swa_kv", &[s, 512], randn(r, s * 512, 1.0))
            } else {
                arg("swa_kv", &[s, 528], Content::U8(records(r, s, 528)))
            };
            let ids = |r: &mut Source<'_>, k: usize, rows: usize| {
                Content::I32(
                    (0..t * k)
                        .map(|_| r.random_range(-1..rows as i32))
                        .collect(),
                )
            };
            // Lengths may run past K (clamped) or be negative (nothing attended).
            let lens = |r: &mut Source<'_>, k: usize| {
                Content::I32((0..t).map(|_| r.random_range(-1..=k as i32 + 1)).collect())
            };
            let (mi, si) = (ids(r, km, n), ids(r, ks, s));
            let (ml, sl) = (lens(r, km), lens(r, ks));
            vec![
                arg("q", &[t, h, 512], randn(r, t * h * 512, 1.0)),
                main,
                arg("main_idx", &[t, km], mi),
                opt(arg("main_len", &[t], ml), r.random_bool(0.5)),
                swa,
                arg("swa_idx", &[t, ks], si),
                opt(arg("swa_len", &[t], sl), r.random_bool(0.5)),
                arg("sink", &[h], randn(r, h, 1.0)),
                out(arg("out", &[t, h, 512], Content::F32(vec![]))),
                out(arg("lse", &[t, h], Content::F32(vec![]))),
            ]
        }
        "mhc" => {
            let d = r.random_range(1..9usize);
            let upd = r.random_bool(0.5);
            let next = r.random_bool(0.5);
            if r.random_bool(0.5) {
                mhc_params = Some(Csa2MhcParams {
                    post_mult: 2.0,
                    sinkhorn_iters: r.random_range(1..25),
                    hc_eps: 1e-6,
                    rms_eps: 1e-6,
                });
            }
            let pre: Vec<f32> = (0..t * 4).map(|_| r.random_range(0.0..1.0)).collect();
            let comb: Vec<f32> = (0..t * 16).map(|_| r.random_range(0.0..0.5)).collect();
            vec![
                arg("x", &[t, 4, d], randn(r, t * 4 * d, 1.0)),
                opt(arg("y", &[t, d], randn(r, t * d, 1.0)), upd),
                opt(arg("post", &[t, 4], randn(r, t * 4, 1.0)), upd),
                opt(arg("comb", &[t, 4, 4], Content::F32(comb)), upd),
                arg("pre_prev", &[t, 4], Content::F32(pre)),
                opt(arg("hc_fn", &[24, 4 * d], randn(r, 96 * d, 0.1)), next),
                opt(arg("hc_base", &[24], randn(r, 24, 0.5)), next),
                opt(arg("hc_scale", &[3], randn(r, 3, 1.0)), next),
                arg("norm", &[d], randn(r, d, 1.0)),
                out(arg("x_new", &[t, 4, d], Content::F32(vec![]))),
                out(arg("layer_in", &[t, d], Content::F32(vec![]))),
                out(opt(arg("pre_out", &[t, 4], Content::F32(vec![])), next)),
                out(opt(arg("post_out", &[t, 4], Content::F32(vec![])), next)),
                out(opt(arg("comb_out", &[t, 4, 4], Content::F32(vec![])), next)),
            ]
        }
        "indexer_in_blocks" => {
            let (h, n, m, bs) = (
                r.random_range(1..5usize),
                r.random_range(1..17usize),
                r.random_range(1..3usize),
                r.random_range(1..5usize),
            );
            let nb = n.div_ceil(bs);
            let b = r.random_range(0..4usize);
            scalars = vec![m as i64, bs as i64, r.random_range(0..3)];
            let blocks: Vec<i32> = (0..t * b).map(|_| r.random_range(-1..nb as i32)).collect();
            vec![
                arg("q", &[t, h, 128], randn(r, t * h * 128, 1.0)),
                arg("w", &[t, h], randn(r, t * h, 1.0)),
                arg("positions", &[t], positions(r, t, n * m)),
                arg("keys", &[n, 128], randn(r, n * 128, 1.0)),
                arg("blocks", &[t, b], Content::I32(blocks)),
                out(arg("logits_out", &[t, n], Content::F32(vec![]))),
            ]
        }
        "compress_step" => {
            let full: Vec<_> = plan.iter().filter(|p| p.1 == 1 || p.1 == 2).collect();
            let (layer, m) = *full[r.random_range(0..full.len())];
            let m = m as usize;
            // Tokens fed by a clean first step (an odd one stays carried for ratio 2).
            let pre = r.random_range(0..3usize);
            let e = (pre % m + t) / m;
            scalars = vec![
                layer as i64,
                (m * r.random_range(0..100)) as i64,
                pre as i64,
            ];
            vec![
                arg("kv", &[t, 512], randn(r, t * 512, 1.0)),
                opt(arg("score", &[t, 512], randn(r, t * 512, 1.0)), m == 2),
                arg("norm", &[512], Content::F32(vec![1.0; 512])),
                arg("wk", &[128, 512], Content::F32(wk.to_vec())),
                arg("k_norm", &[128], Content::F32(vec![1.0; 128])),
                out(arg("main_kv_out", &[e, 288], Content::U8(vec![]))),
                out(arg("index_k_out", &[e, 68], Content::U8(vec![]))),
            ]
        }
        "cache_write" | "cache_read" => {
            let src = plan
                .iter()
                .filter(|p| x.sources.contains(&p.0))
                .collect::<Vec<_>>();
            let (layer, m) = *src[r.random_range(0..src.len())];
            let kind = r.random_range(0..2usize);
            // Adopt the published prefix block (read-only) as block 0, then allocate up to 2 blocks.
            let adopt = r.random_bool(0.3);
            let tokens = r
                .random_range(1..=512usize)
                .max(if adopt { 257 } else { 1 });
            let per_block = 256 / m as usize;
            let cap = tokens.div_ceil(256) * per_block;
            let lo = if adopt { per_block } else { 0 };
            let n = r.random_range(0..4usize);
            let read = EXPORTS[export] == "cache_read";
            let entries: Vec<i64> = (0..n)
                .map(|_| {
                    if read && r.random_bool(0.2) {
                        -1
                    } else {
                        r.random_range(lo..cap) as i64
                    }
                })
                .collect();
            let (dim, rec) = if kind == 0 { (512, 288) } else { (128, 68) };
            scalars = vec![layer as i64, kind as i64, adopt as i64, tokens as i64];
            let rows = if r.random_bool(0.5) {
                arg("rows", &[n, dim], randn(r, n * dim, 1.0))
            } else {
                arg("rows", &[n, rec], Content::U8(records(r, n, rec)))
            };
            vec![
                arg("entries", &[n], Content::I64(entries)),
                if read { out(rows) } else { rows },
            ]
        }
        "swa_write" | "swa_read" => {
            let layer = r.random_range(0..plan.len()) as i64;
            let n = r.random_range(0..4usize);
            let first = r.random_range(0..300usize);
            // A read looks inside what a clean write put in: `first .. first + 4` is written first.
            let pos = if EXPORTS[export] == "swa_read" {
                first + r.random_range(0..=4 - n)
            } else {
                first
            };
            scalars = vec![layer, pos as i64, first as i64];
            let rows = if r.random_bool(0.5) {
                arg("rows", &[n, 512], randn(r, n * 512, 1.0))
            } else {
                arg("rows", &[n, 528], Content::U8(records(r, n, 528)))
            };
            vec![if EXPORTS[export] == "swa_read" {
                out(rows)
            } else {
                rows
            }]
        }
        "compressor_slot" => {
            let two: Vec<_> = plan
                .iter()
                .filter(|p| p.1 == 2 && x.sources.contains(&p.0))
                .collect();
            let layer = two[r.random_range(0..two.len())].0;
            scalars = vec![layer as i64];
            vec![opt(
                arg("state", &[1024], randn(r, 1024, 1.0)),
                r.random_bool(0.7),
            )]
        }
        _ => unreachable!(),
    };
    Case {
        export,
        args,
        scalars,
        mhc_params,
        mutations: Vec::new(),
        kinds: Vec::new(),
        must_fail: false,
        null_handle: false,
        no_request: false,
    }
}

const ACCEPTED: [(u8, u8); 6] = [(2, 32), (4, 16), (2, 16), (1, 8), (0, 32), (0, 64)];

fn mutate(r: &mut Source<'_>, c: &mut Case) {
    let n = c.args.len();
    let i = r.random_range(0..n);
    let family2 = (FAMILY1..FAMILY3_START).contains(&c.export);
    let kind = r.random_range(0..if family2 { KINDS2 } else { KINDS1 });
    let a = &mut c.args[i];
    let name = a.name;
    let note = match kind {
        0 => {
            if a.present {
                a.null_desc = true;
                format!("null {name}")
            } else {
                a.present = true;
                format!("add optional {name}")
            }
        }
        1 => {
            let v = [-5, -1, 9, 100, i32::MAX, i32::MIN][r.random_range(0..6)];
            a.ndim = v;
            format!("{name}.ndim={v}")
        }
        2 => {
            a.ndim = r.random_range(0..=8);
            format!("{name}.ndim={}", a.ndim)
        }
        3 => {
            let d = r.random_range(0..8);
            let v = [-1, i64::MIN, -(1 << 40)][r.random_range(0..3)];
            a.shape[d] = v;
            format!("{name}.shape[{d}]={v}")
        }
        4 => {
            let d = r.random_range(0..8);
            let v = [0, 1, 2, 3, 7, 68, 512, 1 << 40, i64::MAX][r.random_range(0..9)];
            a.shape[d] = v;
            format!("{name}.shape[{d}]={v}")
        }
        5 => {
            let (code, bits, lanes) = (
                r.random_range(0..8u8),
                [1u8, 8, 16, 32, 64, 128][r.random_range(0..6)],
                [1u16, 1, 2, 4][r.random_range(0..4)],
            );
            a.dtype = DLDataType { code, bits, lanes };
            format!("{name}.dtype=({code},{bits},{lanes})")
        }
        6 => {
            let v = [0, 2, 4, 7, 8, 10, 13, 16, -1, i32::MAX][r.random_range(0..10)];
            a.device.device_type = v;
            a.device.device_id = r.random_range(-1..3);
            format!("{name}.device={v}")
        }
        7 => {
            let mut s = [0i64; 8];
            s.iter_mut()
                .for_each(|x| *x = [0, 1, 2, -1, 512, i64::MAX][r.random_range(0..6)]);
            a.strides = Some(s);
            format!("{name}.strides={:?}", &s[..a.ndim.clamp(0, 8) as usize])
        }
        8 => {
            let v =
                [1u64, 2, 3, 4, 8, u64::MAX, u64::MAX - 7, u64::MAX - 4096][r.random_range(0..8)];
            a.byte_offset = v;
            format!("{name}.byte_offset={v}")
        }
        9 => {
            a.null_data = true;
            format!("{name}.data=null")
        }
        10 => {
            let outs: Vec<usize> = (0..n).filter(|&k| c.args[k].output).collect();
            if outs.is_empty() || n < 2 {
                return;
            }
            let o = outs[r.random_range(0..outs.len())];
            let mut t = r.random_range(0..n);
            if t == o {
                t = (t + 1) % n;
            }
            c.args[o].alias_of = Some(t);
            format!("{} aliases {}", c.args[o].name, c.args[t].name)
        }
        11 => {
            if c.scalars.is_empty() {
                return;
            }
            let s = r.random_range(0..c.scalars.len());
            let v = [
                -1,
                0,
                1,
                2,
                3,
                7,
                1000,
                i32::MAX as i64,
                u32::MAX as i64,
                f32::NAN.to_bits() as i64,
            ][r.random_range(0..10)];
            c.scalars[s] = v;
            format!("scalar[{s}]={v}")
        }
        13 => match EXPORTS[c.export] {
            "indexer_in_blocks" => return,
            "compress_step" => {
                c.null_handle = true;
                "null state handle".to_string()
            }
            _ if r.random_bool(0.5) => {
                c.null_handle = true;
                "null cache handle".to_string()
            }
            _ => {
                c.no_request = true;
                format!("request {REQ} not registered")
            }
        },
        _ => match &mut a.content {
            Content::F32(v) if !v.is_empty() => {
                let k = r.random_range(0..v.len());
                v[k] = [f32::NAN, f32::INFINITY, -f32::INFINITY, 1e30][r.random_range(0..4)];
                format!("{name}[{k}]={}", v[k])
            }
            Content::I32(v) if !v.is_empty() => {
                let k = r.random_range(0..v.len());
                v[k] = [-2, -1, i32::MAX, i32::MIN, 1000][r.random_range(0..5)];
                format!("{name}[{k}]={}", v[k])
            }
            Content::I64(v) if !v.is_empty() => {
                let k = r.random_range(0..v.len());
                v[k] = [-1, i64::MIN, i64::MAX, 1 << 40][r.random_range(0..4)];
                format!("{name}[{k}]={}", v[k])
            }
            _ => return,
        },
    };
    c.mutations.push(note);
    c.kinds.push(kind);
}

/// Builds case `seed` (deterministic): a valid template plus 0–3 mutations (none when `seed` is a
/// multiple of 8, so every export is also exercised on valid input).
pub fn build(seed: u64, x: &Ctx) -> Case {
    let mut r = Source::Seeded(Box::new(StdRng::seed_from_u64(seed)));
    let family = if seed & FAMILY2 != 0 {
        2
    } else if seed & FAMILY3 != 0 {
        3
    } else {
        1
    };
    build_from(
        &mut r,
        family,
        !(seed & !(FAMILY2 | FAMILY3)).is_multiple_of(8),
        x,
    )
}

/// Builds a case whose every choice comes from `r`: a valid template of one export of the chosen
/// family (1, 2 or 3) plus 1–3 mutations when `mutated`.
fn build_from(r: &mut Source<'_>, family: u8, mutated: bool, x: &Ctx) -> Case {
    let export = match family {
        2 => r.random_range(FAMILY1..FAMILY3_START),
        3 => r.random_range(FAMILY3_START..EXPORTS.len()),
        _ => r.random_range(0..FAMILY1),
    };
    let mut c = template(r, export, x);
    if mutated {
        for _ in 0..r.random_range(1..4) {
            mutate(r, &mut c);
        }
    }
    // Invalid by itself, judged on the final state (a later mutation may undo an earlier one).
    c.must_fail = c.args.iter().any(|a| {
        if a.null_desc {
            return a.present && !a.optional;
        }
        a.present
            && (!(0..=8).contains(&a.ndim)
                || a.shape[..a.ndim as usize].iter().any(|&d| d < 0)
                || a.dtype.lanes != 1
                || !ACCEPTED.contains(&(a.dtype.code, a.dtype.bits))
                || ![1, 3, 13].contains(&a.device.device_type))
    }) || c.null_handle
        || c.no_request;
    for a in &mut c.args {
        a.materialize();
    }
    // Aliases: point the output at the other argument's memory, only where that memory covers the
    // output's claim (otherwise the harness itself would hand over unbacked memory).
    // An alias onto an argument that itself aliases something would point at memory nobody else
    // uses (chains and cycles): drop those, judged on the state before any is dropped.
    let chained: Vec<bool> = (0..c.args.len())
        .map(|k| {
            c.args[k]
                .alias_of
                .is_some_and(|t| c.args[t].alias_of.is_some())
        })
        .collect();
    for (a, drop) in c.args.iter_mut().zip(chained) {
        if drop {
            a.alias_of = None;
        }
    }
    for k in 0..c.args.len() {
        let Some(t) = c.args[k].alias_of else {
            continue;
        };
        let target_bytes = c.args[t].buf.len() * 8;
        let fits = c.args[k]
            .claimed()
            .is_some_and(|b| b + c.args[k].byte_offset.min(64) as u128 <= target_bytes as u128);
        if fits && !c.args[k].null_data {
            let both_live = c.args[k].present
                && !c.args[k].null_desc
                && c.args[t].present
                && !c.args[t].null_desc
                && !c.args[t].null_data
                && c.args[k].numel_positive()
                && c.args[t].numel_positive()
                && c.args[k].byte_offset == 0
                && c.args[t].byte_offset == 0
                && c.args[k].claimed().is_some_and(|b| b > 0)
                && c.args[t].claimed().is_some_and(|b| b > 0);
            c.must_fail |= both_live;
        } else {
            c.args[k].alias_of = None;
        }
    }
    c
}

/// Runs the case; returns the status and the last error the call left.
fn call(c: &mut Case, x: &Ctx) -> (Csa2Status, String) {
    let g = x.g as *const Csa2Geometry;
    // Point every descriptor at its own (or its alias target's) memory.
    let ptrs: Vec<*mut c_void> = c
        .args
        .iter_mut()
        .map(|a| a.buf.as_mut_ptr() as *mut c_void)
        .collect();
    for k in 0..c.args.len() {
        let data = ptrs[c.args[k].alias_of.unwrap_or(k)];
        c.args[k].fix_pointers(data);
    }
    let p: Vec<*const DLTensor> = c.args.iter().map(Arg::ptr).collect();
    let s = &c.scalars;
    let status = unsafe {
        match EXPORTS[c.export] {
            "rope" => csa2_rope(g, s[0] as u32, p[0], p[1], s[1] as i32),
            "compress" => csa2_compress(&csa2::ffi::Csa2CompressArgs {
                geometry: g,
                layer: s[0] as u32,
                kv: p[0],
                score: p[1],
                norm: p[2],
                wk: p[3],
                k_norm: p[4],
                start_pos: s[1],
                main_kv_out: p[5],
                index_k_out: p[6],
                ..Default::default()
            }),
            "indexer_logits" => csa2_indexer_logits(&csa2::ffi::Csa2IndexerLogitsArgs {
                q: p[0],
                w: p[1],
                positions: p[2],
                keys: p[3],
                ratio: s[0] as u32,
                q_quant: s[1] as i32,
                logits_out: p[4],
                ..Default::default()
            }),
            "topk" => csa2_topk(p[0], p[1], s[0] as u32, p[2], p[3]),
            "candidates" => csa2_candidates(p[0], p[1], s[0] as u32, s[1] as u32, p[2]),
            "attention" => csa2_attention(&csa2::ffi::Csa2AttentionArgs {
                q: p[0],
                main_kv: p[1],
                main_format: s[0] as i32,
                swa: p[2],
                swa_format: s[1] as i32,
                topk: p[3],
                topk_len: p[4],
                positions: p[5],
                replay_start: p[6],
                sink: p[7],
                window: s[2] as u32,
                ratio: s[3] as u32,
                scale: f32::from_bits(s[4] as u32),
                out: p[8],
                lse: p[9],
                ..Default::default()
            }),
            "mhc" => csa2_mhc(&csa2::ffi::Csa2MhcArgs {
                params: c
                    .mhc_params
                    .as_ref()
                    .map_or(std::ptr::null(), |m| m as *const _),
                x: p[0],
                y: p[1],
                post: p[2],
                comb: p[3],
                pre_prev: p[4],
                hc_fn: p[5],
                hc_base: p[6],
                hc_scale: p[7],
                norm: p[8],
                x_new: p[9],
                layer_in: p[10],
                pre_out: p[11],
                post_out: p[12],
                comb_out: p[13],
                ..Default::default()
            }),
            "indexer_in_blocks" => {
                csa2_indexer_logits_in_blocks(&csa2::ffi::Csa2IndexerLogitsInBlocksArgs {
                    q: p[0],
                    w: p[1],
                    positions: p[2],
                    keys: p[3],
                    blocks: p[4],
                    ratio: s[0] as u32,
                    block_size: s[1] as u32,
                    q_quant: s[2] as i32,
                    logits_out: p[5],
                    ..Default::default()
                })
            }
            "attention_indexed" => csa2_attention_indexed(&csa2::ffi::Csa2AttentionIndexedArgs {
                q: p[0],
                main_kv: p[1],
                main_format: s[0] as i32,
                main_idx: p[2],
                main_len: p[3],
                swa_kv: p[4],
                swa_format: s[1] as i32,
                swa_idx: p[5],
                swa_len: p[6],
                sink: p[7],
                scale: f32::from_bits(s[2] as u32),
                out: p[8],
                lse: p[9],
                ..Default::default()
            }),
            "compress_step" => compress_step(c, x, &p),
            "cache_write" | "cache_read" | "swa_write" | "swa_read" | "compressor_slot" => {
                return cache_call(c, x, &p);
            }
            _ => unreachable!(),
        }
    };
    (status, last_error())
}

/// `csa2_compress_step` on a fresh state at `scalars[1]` that a clean first step fed
/// `scalars[2]` tokens (so an odd token may be carried into the fuzzed call).
unsafe fn compress_step(c: &Case, x: &Ctx, p: &[*const DLTensor]) -> Csa2Status {
    let (g, s) = (x.g as *const Csa2Geometry, &c.scalars);
    let mut st = std::ptr::null_mut();
    let created = unsafe { csa2_compressor_state_create(g, s[0] as u32, s[1] as u64, &mut st) };
    if created != Csa2Status::Csa2Ok && !c.null_handle {
        return created;
    }
    let m = x.plan.get(s[0] as usize).map_or(1, |l| l.1.max(1) as usize);
    let pre = s[2].clamp(0, 2) as usize;
    if !st.is_null() && pre > 0 {
        let mut kv = vec![0.25f32; pre * 512];
        let mut sc = vec![0.5f32; pre * 512];
        let mut norm = vec![1.0f32; 512];
        let mut wk = x.wk.clone();
        let mut kn = vec![1.0f32; 128];
        let e = pre / m;
        let (mut mo, mut io) = (vec![0u8; e * 288], vec![0u8; e * 68]);
        let mut shapes = [
            [pre as i64, 512],
            [pre as i64, 512],
            [512, 0],
            [128, 512],
            [128, 0],
            [e as i64, 288],
            [e as i64, 68],
        ];
        let d = |data: *mut c_void, shape: &mut [i64; 2], nd: i32, code: u8, bits: u8| DLTensor {
            data,
            device: DLDevice {
                device_type: K_DL_CPU,
                device_id: 0,
            },
            ndim: nd,
            dtype: dt(code, bits),
            shape: shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        let [s0, s1, s2, s3, s4, s5, s6] = &mut shapes;
        let kvd = d(kv.as_mut_ptr().cast(), s0, 2, 2, 32);
        let scd = d(sc.as_mut_ptr().cast(), s1, 2, 2, 32);
        let nd = d(norm.as_mut_ptr().cast(), s2, 1, 2, 32);
        let wkd = d(wk.as_mut_ptr().cast(), s3, 2, 2, 32);
        let knd = d(kn.as_mut_ptr().cast(), s4, 1, 2, 32);
        let mod_ = d(mo.as_mut_ptr().cast(), s5, 2, 1, 8);
        let iod = d(io.as_mut_ptr().cast(), s6, 2, 1, 8);
        let first = unsafe {
            csa2_compress_step(&csa2::ffi::Csa2CompressStepArgs {
                geometry: g,
                layer: s[0] as u32,
                state: st,
                kv: &kvd,
                score: if m == 2 { &scd } else { std::ptr::null() },
                norm: &nd,
                wk: &wkd,
                k_norm: &knd,
                main_kv_out: &mod_,
                index_k_out: &iod,
                first_entry: std::ptr::null_mut(),
                ..Default::default()
            })
        };
        assert_ne!(
            first,
            Csa2Status::Csa2ErrPanic,
            "clean first step: {}",
            last_error()
        );
        if first != Csa2Status::Csa2Ok {
            // Refused for a mutated scalar (e.g. a start position at the end of the range).
            unsafe { csa2_compressor_state_free(st) };
            return first;
        }
    }
    let mut first_entry = 0u64;
    let status = unsafe {
        csa2_compress_step(&csa2::ffi::Csa2CompressStepArgs {
            geometry: g,
            layer: s[0] as u32,
            state: if c.null_handle { std::ptr::null() } else { st },
            kv: p[0],
            score: p[1],
            norm: p[2],
            wk: p[3],
            k_norm: p[4],
            main_kv_out: p[5],
            index_k_out: p[6],
            first_entry: &mut first_entry,
            ..Default::default()
        })
    };
    unsafe { csa2_compressor_state_free(st) };
    status
}

/// The record-level cache exports on request [`REQ`], registered (unless mutated away), given the
/// published prefix block when `scalars[2]` says so, and freed again afterwards.
unsafe fn cache_call(c: &Case, x: &Ctx, p: &[*const DLTensor]) -> (Csa2Status, String) {
    let (m, s) = (x.cache as *const Csa2Cache, &c.scalars);
    let handle = if c.null_handle { std::ptr::null() } else { m };
    let status = (|| unsafe {
        if !c.no_request {
            assert_eq!(csa2_cache_add_request(m, REQ), Csa2Status::Csa2Ok);
        }
        let layer = s[0] as u32;
        match EXPORTS[c.export] {
            "cache_write" | "cache_read" => {
                if !c.no_request {
                    if s[2] != 0 {
                        let mut n = 0usize;
                        let a = csa2_cache_adopt_prefix(m, REQ, x.key.as_ptr(), 1, &mut n);
                        assert_eq!((a, n), (Csa2Status::Csa2Ok, 1));
                    }
                    let a = csa2_cache_allocate(m, REQ, s[3] as usize);
                    if a != Csa2Status::Csa2Ok {
                        return a;
                    }
                }
                if EXPORTS[c.export] == "cache_write" {
                    csa2_cache_write_entries(handle, REQ, layer, s[1] as i32, p[0], p[1])
                } else {
                    csa2_cache_read_entries(handle, REQ, layer, s[1] as i32, p[0], p[1])
                }
            }
            "swa_write" => csa2_cache_swa_write(handle, REQ, layer, s[1] as u64, p[0]),
            "swa_read" => {
                if !c.no_request {
                    let mut rows = vec![0.5f32; 4 * 512];
                    let mut shape = [4i64, 512];
                    let d = DLTensor {
                        data: rows.as_mut_ptr().cast(),
                        device: DLDevice {
                            device_type: K_DL_CPU,
                            device_id: 0,
                        },
                        ndim: 2,
                        dtype: dt(2, 32),
                        shape: shape.as_mut_ptr(),
                        strides: std::ptr::null_mut(),
                        byte_offset: 0,
                    };
                    let w = csa2_cache_swa_write(m, REQ, layer, s[2] as u64, &d);
                    if w != Csa2Status::Csa2Ok {
                        return w;
                    }
                }
                csa2_cache_swa_read(handle, REQ, layer, s[1] as u64, p[0])
            }
            "compressor_slot" => csa2_cache_set_compressor_state(handle, REQ, layer, p[0]),
            _ => unreachable!(),
        }
    })();
    // The last error of the call itself: freeing the request is a fallible call that clears it.
    let msg = last_error();
    if !c.no_request {
        assert_eq!(
            unsafe { csa2_cache_free_request(m, REQ) },
            Csa2Status::Csa2Ok
        );
    }
    (status, msg)
}

fn last_error() -> String {
    let n = unsafe { csa2_last_error_message(std::ptr::null_mut(), 0) };
    if n == 0 {
        return String::new();
    }
    let mut b = vec![0 as std::ffi::c_char; n];
    unsafe { csa2_last_error_message(b.as_mut_ptr(), n) };
    unsafe { std::ffi::CStr::from_ptr(b.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Runs case `seed` and checks the invariants; returns the case and its status.
pub fn run(seed: u64, x: &Ctx) -> (Case, Csa2Status) {
    check(build(seed, x), &format!("seed {seed}"), x)
}

/// Runs the case that the fuzzer input `data` encodes (libFuzzer's byte string, or a file of
/// `tests/fuzz_corpus/libfuzzer/`) and checks the invariants. Byte 0 picks the family (bits 2–5
/// = `0011`: the third; else bit 0) and whether to mutate (bit 1); every later choice reads the
/// following bytes (zeros once they run out), so coverage-guided mutation of the input steers the
/// template and the mutations directly.
pub fn run_bytes(data: &[u8], x: &Ctx) -> (Case, Csa2Status) {
    let flags = data.first().copied().unwrap_or(0);
    let mut r = Source::Bytes(data.get(1..).unwrap_or(&[]));
    let family = if flags & FAMILY3_MASK == FAMILY3_BITS {
        3
    } else if flags & 1 == 1 {
        2
    } else {
        1
    };
    let c = build_from(&mut r, family, flags & 2 == 2, x);
    check(c, &format!("input of {} bytes", data.len()), x)
}

fn check(mut c: Case, what: &str, x: &Ctx) -> (Case, Csa2Status) {
    let (st, msg) = call(&mut c, x);
    let ctx = || {
        format!(
            "{what}, export {}, mutations {:?}: status {st:?}, last error `{msg}`",
            EXPORTS[c.export], c.mutations
        )
    };
    assert_ne!(st, Csa2Status::Csa2ErrPanic, "{}", ctx());
    assert_eq!(st == Csa2Status::Csa2Ok, msg.is_empty(), "{}", ctx());
    if c.mutations.is_empty() {
        assert_eq!(st, Csa2Status::Csa2Ok, "valid case failed: {}", ctx());
    }
    if c.must_fail {
        assert_ne!(st, Csa2Status::Csa2Ok, "bad input accepted: {}", ctx());
    }
    (c, st)
}

fn wk_pool() -> Vec<f32> {
    let mut r = StdRng::seed_from_u64(1);
    (0..128 * 512)
        .map(|_| r.random_range(-0.05..0.05))
        .collect()
}

/// `tests/fuzz_corpus/` of this repository.
pub fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fuzz_corpus")
}
