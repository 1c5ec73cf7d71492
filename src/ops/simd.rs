//! Instruction-set detection shared by the fast paths.
//!
//! Kernels are written once as `#[inline(always)]` generic bodies over a lane count and compiled
//! three times: inside an `avx512f` wrapper, an `avx2,fma` wrapper and a portable one. This module
//! only decides which wrapper runs; the wrappers live next to their kernels.

use std::sync::OnceLock;

/// The instruction set the fast paths use on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F (+ AVX2/FMA): 16 f32 lanes, 32 vector registers.
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

/// Calls `$body::<L>(args…)` compiled for the detected ISA (L = 16 on AVX-512, 8 otherwise).
///
/// `$body` must be an `#[inline(always)]` generic function so that its code is generated inside the
/// `target_feature` wrapper.
macro_rules! multiversion {
    ($name:ident, fn($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)?, $body:ident) => {
        #[allow(clippy::too_many_arguments)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v512($($arg: $ty),*) $(-> $ret)? { $body::<16>($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v256($($arg: $ty),*) $(-> $ret)? { $body::<8>($($arg),*) }
                match $crate::ops::simd::isa() {
                    // SAFETY: `isa()` reported these CPU features present at run time.
                    $crate::ops::simd::Isa::Avx512 => return unsafe { v512($($arg),*) },
                    // SAFETY: as above, AVX2 and FMA were detected.
                    $crate::ops::simd::Isa::Avx2 => return unsafe { v256($($arg),*) },
                    $crate::ops::simd::Isa::Portable => {}
                }
            }
            $body::<8>($($arg),*)
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
    // Each iteration: 12 accumulators × L lanes FMAs; L depends on the path taken.
    let lanes = if isa() == Isa::Avx512 { 16.0 } else { 8.0 };
    iters as f64 * 12.0 * lanes * 2.0 / secs / 1e9
}

/// 12 independent accumulator vectors of L lanes: enough to cover the FMA latency.
#[inline(always)]
fn peak_body<const L: usize>(iters: usize) -> f32 {
    let mut acc = [[0f32; L]; 12];
    let a = std::hint::black_box([0.999_f32; L]);
    let b = std::hint::black_box([1e-3_f32; L]);
    for _ in 0..iters {
        for r in acc.iter_mut() {
            for l in 0..L {
                r[l] = r[l].mul_add(a[l], b[l]);
            }
        }
    }
    acc.iter().flatten().sum()
}
