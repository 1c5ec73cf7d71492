//! Instruction-set detection shared by the fast paths.
//!
//! Kernels are written once as `#[inline(always)]` generic bodies over a lane count and compiled
//! three times: inside an `avx512f` wrapper, an `avx2,fma` wrapper and a portable one. This module
//! only decides which wrapper runs; the wrappers live next to their kernels.

use std::sync::OnceLock;

/// The instruction set the fast paths use on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F present (kernels run their AVX2 + FMA version; see [`multiversion`]).
    Avx512,
    /// AVX2 + FMA: 8 f32 lanes.
    Avx2,
    /// Whatever the baseline target gives (SSE2 on x86-64, NEON on aarch64).
    Portable,
}

/// Detected once; `CSA2_ISA=portable|avx2|avx512` caps it (for tests and benchmarks).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let detected = detect();
        let cap = match std::env::var("CSA2_ISA").as_deref() {
            Ok("portable") => Isa::Portable,
            Ok("avx2") => Isa::Avx2,
            _ => Isa::Avx512,
        };
        match (detected, cap) {
            (Isa::Avx512, c) => c,
            (Isa::Avx2, Isa::Avx512) => Isa::Avx2,
            (Isa::Avx2, c) => c,
            (Isa::Portable, _) => Isa::Portable,
        }
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    if is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
    {
        Isa::Avx512
    } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        Isa::Avx2
    } else {
        Isa::Portable
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Portable
}

/// Calls `$body::<V>(args…)` compiled for the detected ISA, V = [`F32x8`] (AVX2 + FMA, also used on
/// AVX-512 machines) or [`Portable8`].
///
/// AVX-512 intrinsics need Rust 1.89 while the crate's MSRV is 1.85; on Zen 4 (the dev machine)
/// 512-bit FMAs are double-pumped and measured no faster than AVX2 (research/toolchain.md §5).
/// A 16-lane type can be added here once the MSRV moves.
///
/// `$body` must be an `#[inline(always)]` generic function so that its code is generated inside the
/// `target_feature` wrapper.
macro_rules! multiversion {
    ($name:ident, fn($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)?, $body:ident) => {
        #[allow(clippy::too_many_arguments)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v256($($arg: $ty),*) $(-> $ret)? {
                    $body::<$crate::ops::simd::F32x8>($($arg),*)
                }
                if $crate::ops::simd::isa() != $crate::ops::simd::Isa::Portable {
                    // SAFETY: `isa()` reported AVX2 and FMA present at run time.
                    return unsafe { v256($($arg),*) };
                }
            }
            $body::<$crate::ops::simd::Portable8>($($arg),*)
        }
    };
}
#[allow(unused_imports)]
pub(crate) use multiversion;

/// Measures this machine's f32 FMA throughput on the calling thread, in GFLOP/s (2 flop per FMA):
/// the "peak" that benchmark GMAC/s figures are compared to. Runs about `millis` milliseconds.
pub fn fma_peak_gflops(millis: u64) -> f64 {
    multiversion!(peak_mv, fn(iters: usize) -> f32, peak_body);
    let t0 = std::time::Instant::now();
    let mut iters = 0usize;
    let mut sink = 0f32;
    while t0.elapsed().as_millis() < millis as u128 {
        sink += peak_mv(1 << 16);
        iters += 1 << 16;
    }
    let secs = t0.elapsed().as_secs_f64();
    std::hint::black_box(sink);
    // Each iteration: 12 accumulators × 8 lanes FMAs.
    iters as f64 * 12.0 * 8.0 * 2.0 / secs / 1e9
}

/// 12 independent accumulator vectors: enough to cover the FMA latency.
#[inline(always)]
fn peak_body<V: Vf32>(iters: usize) -> f32 {
    let a = V::splat(std::hint::black_box(0.999));
    let b = V::splat(std::hint::black_box(1e-3));
    let mut acc = [V::splat(0.0); 12];
    for _ in 0..iters {
        for r in acc.iter_mut() {
            *r = V::fmadd(*r, a, b);
        }
    }
    let mut out = [0f32; 16];
    let mut total = 0.0;
    for r in acc {
        // SAFETY: `out` holds 16 ≥ V::L floats.
        unsafe { r.store(out.as_mut_ptr()) };
        total += out[..V::L].iter().sum::<f32>();
    }
    total
}

/// An f32 vector of `L` lanes, the one abstraction the kernels are written against.
///
/// Loads and stores take raw pointers: callers guarantee `L` readable / writable floats.
pub(crate) trait Vf32: Copy {
    /// Lanes.
    const L: usize;
    /// All lanes `x`.
    fn splat(x: f32) -> Self;
    /// Loads `L` floats (unaligned).
    ///
    /// # Safety
    /// `p` must point to `L` readable f32.
    unsafe fn load(p: *const f32) -> Self;
    /// Stores `L` floats (unaligned).
    ///
    /// # Safety
    /// `p` must point to `L` writable f32.
    unsafe fn store(self, p: *mut f32);
    /// `a · b + c` (fused where the ISA has FMA).
    fn fmadd(a: Self, b: Self, c: Self) -> Self;
    /// Lane-wise max.
    fn max(a: Self, b: Self) -> Self;
}

/// 8 lanes of AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct F32x8(std::arch::x86_64::__m256);

#[cfg(target_arch = "x86_64")]
impl Vf32 for F32x8 {
    const L: usize = 8;
    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: only reached inside `target_feature(enable = "avx2,fma")` code (multiversion!).
        F32x8(unsafe { std::arch::x86_64::_mm256_set1_ps(x) })
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees 8 readable floats; AVX is enabled (see splat).
        F32x8(unsafe { std::arch::x86_64::_mm256_loadu_ps(p) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees 8 writable floats; AVX is enabled (see splat).
        unsafe { std::arch::x86_64::_mm256_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    fn fmadd(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: FMA is enabled (see splat).
        F32x8(unsafe { std::arch::x86_64::_mm256_fmadd_ps(a.0, b.0, c.0) })
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        // SAFETY: AVX is enabled (see splat).
        F32x8(unsafe { std::arch::x86_64::_mm256_max_ps(a.0, b.0) })
    }
}

/// 8 lanes in plain arrays (any target); multiply then add, no fused libm call.
#[derive(Clone, Copy)]
pub(crate) struct Portable8([f32; 8]);

impl Vf32 for Portable8 {
    const L: usize = 8;
    #[inline(always)]
    fn splat(x: f32) -> Self {
        Portable8([x; 8])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees 8 readable floats.
        Portable8(unsafe { std::ptr::read_unaligned(p as *const [f32; 8]) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees 8 writable floats.
        unsafe { std::ptr::write_unaligned(p as *mut [f32; 8], self.0) }
    }
    #[inline(always)]
    fn fmadd(a: Self, b: Self, c: Self) -> Self {
        Portable8(std::array::from_fn(|i| a.0[i] * b.0[i] + c.0[i]))
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        Portable8(std::array::from_fn(|i| a.0[i].max(b.0[i])))
    }
}
