//! Lane types and the `multiversion!` dispatcher of the op kernels.
//!
//! Kernels are written once as `#[inline(always)]` generic bodies over a lane count and compiled
//! three times: inside an `avx512f` wrapper, an `avx2,fma` wrapper and a portable one. Which one
//! runs is [`crate::isa::level`] (detection and the `CSA2_ISA` cap live there, for every kernel
//! family); this module holds the lane types, the peak probes and the dispatch macro.

use std::sync::OnceLock;

/// Calls `$body::<V>(args…)` compiled for the detected ISA: V = [`F32x16`] (AVX-512F), [`F32x8`]
/// (AVX2 + FMA) or [`Portable8`].
///
/// The crate's MSRV (1.89) has the AVX-512 intrinsics. On Sapphire Rapids-class Xeons (two 512-bit
/// FMA ports) the 16-lane version doubles the FMA rate; `CSA2_ISA=avx2` selects the 8-lane one for
/// A/B runs and for CPUs that down-clock on 512-bit code.
///
/// `$body` must be an `#[inline(always)]` generic function so that its code is generated inside the
/// `target_feature` wrapper, and must accept any `V::L` ≤ 16.
macro_rules! multiversion {
    ($name:ident, fn($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)?, $body:ident) => {
        #[allow(clippy::too_many_arguments)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v512($($arg: $ty),*) $(-> $ret)? {
                    $body::<$crate::ops::simd::F32x16>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v256($($arg: $ty),*) $(-> $ret)? {
                    $body::<$crate::ops::simd::F32x8>($($arg),*)
                }
                match $crate::isa::level() {
                    // SAFETY: `level()` reported AVX-512F, AVX2 and FMA present at run time.
                    $crate::isa::Isa::Avx512 => return unsafe { v512($($arg),*) },
                    // SAFETY: `level()` reported AVX2 and FMA present at run time.
                    $crate::isa::Isa::Avx2 => return unsafe { v256($($arg),*) },
                    $crate::isa::Isa::Scalar => {}
                }
            }
            $body::<$crate::ops::simd::Portable8>($($arg),*)
        }
    };
}
#[allow(unused_imports)]
pub(crate) use multiversion;

/// CPU time of the calling thread, in seconds (`CLOCK_THREAD_CPUTIME_ID`): the clock of the peak
/// probes and kernel breakdowns, so that a machine shared with other builds (time slices lost to
/// them) does not deflate the figures; wall time where the platform lacks it.
pub fn thread_cpu_seconds() -> f64 {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid out-pointer; the clock id is a constant the platform defines.
        if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0 {
            return ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9;
        }
    }
    static T0: OnceLock<std::time::Instant> = OnceLock::new();
    T0.get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs_f64()
}

/// Measures this machine's f32 FMA throughput on the calling thread, in GFLOP/s (2 flop per FMA):
/// the "peak" that benchmark GMAC/s figures are compared to. Runs about `millis` milliseconds.
pub fn fma_peak_gflops(millis: u64) -> f64 {
    multiversion!(peak_mv, fn(iters: usize) -> (f32, usize), peak_body);
    let t0 = thread_cpu_seconds();
    let mut iters = 0usize;
    let mut sink = 0f32;
    let mut lanes = 8;
    while thread_cpu_seconds() - t0 < millis as f64 * 1e-3 {
        let (s, l) = peak_mv(1 << 16);
        sink += s;
        lanes = l;
        iters += 1 << 16;
    }
    let secs = thread_cpu_seconds() - t0;
    std::hint::black_box(sink);
    // Each iteration: 12 accumulators × `lanes` FMAs.
    iters as f64 * 12.0 * lanes as f64 * 2.0 / secs / 1e9
}

/// Measured MAC rates (GMAC/s, calling thread's CPU time, about `millis` ms each) of the dot units
/// [`crate::isa::dot_units`] enables: (`vpdpbusd` int8, `vdpbf16ps` bf16); `None` where a unit is off. Each
/// probe runs 12 independent accumulator chains, as [`fma_peak_gflops`] (which gives the f32 rate:
/// GFLOP/s ÷ 2).
pub fn dot_peak_gmacs(millis: u64) -> (Option<f64>, Option<f64>) {
    let u = crate::isa::dot_units();
    let rate = |f: &dyn Fn(usize) -> u64, macs_per_instr: f64| {
        let t0 = thread_cpu_seconds();
        let mut iters = 0usize;
        let mut sink = 0u64;
        while thread_cpu_seconds() - t0 < millis as f64 * 1e-3 {
            sink = sink.wrapping_add(f(1 << 16));
            iters += 1 << 16;
        }
        std::hint::black_box(sink);
        iters as f64 * 12.0 * macs_per_instr / (thread_cpu_seconds() - t0) / 1e9
    };
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY (both closures): `dot_units` reported the unit present at run time.
        let vnni = u.vnni.then(|| rate(&|n| unsafe { probe::vnni(n) }, 64.0));
        let bf16 = u.bf16.then(|| rate(&|n| unsafe { probe::bf16(n) }, 32.0));
        (vnni, bf16)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (u, rate);
        (None, None)
    }
}

/// Measured MAC rate (GMAC/s, calling thread's CPU time, about `millis` ms) of `vpdpwssd`
/// (AVX-512 VNNI, 32 int16 MACs per instruction: the int16 attention scores), `None` where VNNI
/// is off; same 12-chain probe as [`dot_peak_gmacs`].
pub fn int16_dot_peak_gmacs(millis: u64) -> Option<f64> {
    if !crate::isa::dot_units().vnni {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let t0 = thread_cpu_seconds();
        let mut iters = 0usize;
        let mut sink = 0u64;
        while thread_cpu_seconds() - t0 < millis as f64 * 1e-3 {
            // SAFETY: `dot_units` reported VNNI present at run time.
            sink = sink.wrapping_add(unsafe { probe::vnni16(1 << 16) });
            iters += 1 << 16;
        }
        std::hint::black_box(sink);
        Some(iters as f64 * 12.0 * 32.0 / (thread_cpu_seconds() - t0) / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = millis;
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod probe {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) fn vnni16(n: usize) -> u64 {
        let a = _mm512_set1_epi16(std::hint::black_box(3));
        let b = _mm512_set1_epi16(std::hint::black_box(-5));
        let mut acc = [_mm512_setzero_si512(); 12];
        for _ in 0..n {
            for r in acc.iter_mut() {
                *r = _mm512_dpwssd_epi32(*r, a, b);
            }
        }
        acc.iter()
            .map(|&r| _mm512_reduce_add_epi32(r) as u32 as u64)
            .sum()
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) fn vnni(n: usize) -> u64 {
        let a = _mm512_set1_epi8(std::hint::black_box(3));
        let b = _mm512_set1_epi8(std::hint::black_box(-5));
        let mut acc = [_mm512_setzero_si512(); 12];
        for _ in 0..n {
            for r in acc.iter_mut() {
                *r = _mm512_dpbusd_epi32(*r, a, b);
            }
        }
        acc.iter()
            .map(|&r| _mm512_reduce_add_epi32(r) as u32 as u64)
            .sum()
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) fn bf16(n: usize) -> u64 {
        let x = _mm512_set1_ps(std::hint::black_box(1e-3));
        let a = _mm512_cvtne2ps_pbh(x, x);
        let mut acc = [_mm512_setzero_ps(); 12];
        for _ in 0..n {
            for r in acc.iter_mut() {
                *r = _mm512_dpbf16_ps(*r, a, a);
            }
        }
        acc.iter().map(|&r| _mm512_reduce_add_ps(r) as u64).sum()
    }
}

/// 12 independent accumulator vectors: enough to cover the FMA latency.
#[inline(always)]
fn peak_body<V: Vf32>(iters: usize) -> (f32, usize) {
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
    (total, V::L)
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
    /// Sum of the lanes (tree order).
    fn hsum(self) -> f32;
    /// `e^x` lane-wise, ≤ 2 ulp for x in [−87.3, 88.3] (Cody–Waite reduction by ln 2, degree-5
    /// minimax polynomial); below −87.3 it returns e^−87.3 ≈ 1.2e-38 instead of a subnormal or 0;
    /// NaN stays NaN.
    fn exp(self) -> Self;
    /// Whether [`Vf32::fmadd`] rounds once (true for the AVX2 / AVX-512 types, false for
    /// [`Portable8`]): scalar tails use the same kind of multiply-add so a row's bits do not
    /// depend on where the vector part ends.
    const FMA: bool;
    /// The 8-lane vector of the same ISA: the accumulator of [`Vf32::fma_sq8`].
    type A8: Vf32;
    /// Lane-wise `a · b`.
    fn mul(a: Self, b: Self) -> Self;
    /// `acc + self²` summed in 8-lane blocks in lane order (lanes 0..8 first, then 8..16): the
    /// order of an 8-lane accumulator walking the same values, so a sum of squares has the same
    /// bits whether its kernel runs 8 or 16 lanes wide (mHC's RMS statistics rely on it).
    fn fma_sq8(self, acc: Self::A8) -> Self::A8;
}

/// Constants of [`Vf32::exp`]: ln 2 split in a part exact in f32 and the rest, then the
/// minimax coefficients of (e^r − 1 − r) / r² on |r| ≤ ln 2 / 2 (Cephes `expf`).
mod expc {
    pub const HI: f32 = 88.376_26;
    pub const LO: f32 = -87.336_54;
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
}

/// 16 lanes of AVX-512F.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct F32x16(std::arch::x86_64::__m512);

#[cfg(target_arch = "x86_64")]
impl Vf32 for F32x16 {
    const L: usize = 16;
    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: only reached inside `target_feature(enable = "avx512f,…")` code (multiversion!).
        F32x16(unsafe { std::arch::x86_64::_mm512_set1_ps(x) })
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees 16 readable floats; AVX-512F is enabled (see splat).
        F32x16(unsafe { std::arch::x86_64::_mm512_loadu_ps(p) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees 16 writable floats; AVX-512F is enabled (see splat).
        unsafe { std::arch::x86_64::_mm512_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    fn fmadd(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: AVX-512F is enabled (see splat).
        F32x16(unsafe { std::arch::x86_64::_mm512_fmadd_ps(a.0, b.0, c.0) })
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        // SAFETY: AVX-512F is enabled (see splat).
        F32x16(unsafe { std::arch::x86_64::_mm512_max_ps(a.0, b.0) })
    }
    #[inline(always)]
    fn hsum(self) -> f32 {
        // SAFETY: AVX-512F is enabled (see splat).
        unsafe { std::arch::x86_64::_mm512_reduce_add_ps(self.0) }
    }
    #[inline(always)]
    fn exp(self) -> Self {
        use std::arch::x86_64::*;
        // SAFETY: AVX-512F is enabled (see splat).
        unsafe {
            // min/max return their second operand when one is NaN: NaN flows through.
            let x = _mm512_min_ps(_mm512_set1_ps(expc::HI), self.0);
            let x = _mm512_max_ps(_mm512_set1_ps(expc::LO), x);
            let n = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(expc::LOG2E)));
            let nf = _mm512_cvtepi32_ps(n);
            let r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(expc::LN2_HI), x);
            let r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(expc::LN2_LO), r);
            let mut p = _mm512_set1_ps(expc::P[0]);
            for c in &expc::P[1..] {
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
            }
            let y = _mm512_fmadd_ps(
                _mm512_mul_ps(p, r),
                r,
                _mm512_add_ps(r, _mm512_set1_ps(1.0)),
            );
            let two_n = _mm512_slli_epi32::<23>(_mm512_add_epi32(n, _mm512_set1_epi32(127)));
            F32x16(_mm512_mul_ps(y, _mm512_castsi512_ps(two_n)))
        }
    }
    const FMA: bool = true;
    type A8 = F32x8;
    #[inline(always)]
    fn mul(a: Self, b: Self) -> Self {
        // SAFETY: AVX-512F is enabled (see splat).
        F32x16(unsafe { std::arch::x86_64::_mm512_mul_ps(a.0, b.0) })
    }
    #[inline(always)]
    fn fma_sq8(self, acc: F32x8) -> F32x8 {
        use std::arch::x86_64::*;
        // SAFETY: AVX-512F, AVX2 and FMA are enabled (multiversion!'s 512-bit wrapper).
        unsafe {
            let lo = _mm512_castps512_ps256(self.0);
            // (The upper half through the AVX-512F 64-bit extract: the 32-bit one needs AVX-512DQ.)
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0)));
            let a = _mm256_fmadd_ps(lo, lo, acc.0);
            F32x8(_mm256_fmadd_ps(hi, hi, a))
        }
    }
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
    #[inline(always)]
    fn hsum(self) -> f32 {
        use std::arch::x86_64::*;
        // SAFETY: AVX is enabled (see splat).
        unsafe {
            let s = _mm_add_ps(
                _mm256_castps256_ps128(self.0),
                _mm256_extractf128_ps::<1>(self.0),
            );
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
            _mm_cvtss_f32(s)
        }
    }
    #[inline(always)]
    fn exp(self) -> Self {
        use std::arch::x86_64::*;
        // SAFETY: AVX2 and FMA are enabled (see splat).
        unsafe {
            // min/max return their second operand when one is NaN: NaN flows through.
            let x = _mm256_min_ps(_mm256_set1_ps(expc::HI), self.0);
            let x = _mm256_max_ps(_mm256_set1_ps(expc::LO), x);
            let n = _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(expc::LOG2E)));
            let nf = _mm256_cvtepi32_ps(n);
            let r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(expc::LN2_HI), x);
            let r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(expc::LN2_LO), r);
            let mut p = _mm256_set1_ps(expc::P[0]);
            for c in &expc::P[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
            }
            let y = _mm256_fmadd_ps(
                _mm256_mul_ps(p, r),
                r,
                _mm256_add_ps(r, _mm256_set1_ps(1.0)),
            );
            let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(n, _mm256_set1_epi32(127)));
            F32x8(_mm256_mul_ps(y, _mm256_castsi256_ps(two_n)))
        }
    }
    const FMA: bool = true;
    type A8 = F32x8;
    #[inline(always)]
    fn mul(a: Self, b: Self) -> Self {
        // SAFETY: AVX is enabled (see splat).
        F32x8(unsafe { std::arch::x86_64::_mm256_mul_ps(a.0, b.0) })
    }
    #[inline(always)]
    fn fma_sq8(self, acc: F32x8) -> F32x8 {
        F32x8::fmadd(self, self, acc)
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
    #[inline(always)]
    fn hsum(self) -> f32 {
        let a = self.0;
        ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    }
    #[inline(always)]
    fn exp(self) -> Self {
        Portable8(
            self.0
                .map(|x| if x < expc::LO { expc::LO } else { x }.exp()),
        )
    }
    const FMA: bool = false;
    type A8 = Portable8;
    #[inline(always)]
    fn mul(a: Self, b: Self) -> Self {
        Portable8(std::array::from_fn(|i| a.0[i] * b.0[i]))
    }
    #[inline(always)]
    fn fma_sq8(self, acc: Portable8) -> Portable8 {
        Portable8::fmadd(self, self, acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    multiversion!(exp_mv, fn(x: &[f32], out: &mut [f32]), exp_body);

    #[inline(always)]
    fn exp_body<V: Vf32>(x: &[f32], out: &mut [f32]) {
        for (a, o) in x.chunks_exact(V::L).zip(out.chunks_exact_mut(V::L)) {
            // SAFETY: both chunks hold L floats.
            unsafe { V::load(a.as_ptr()).exp().store(o.as_mut_ptr()) };
        }
    }

    /// The peak probe measures exactly the dot units that are on, at a finite positive rate.
    #[test]
    fn dot_probes_follow_the_enabled_units() {
        let u = crate::isa::dot_units();
        let (vnni, bf16) = dot_peak_gmacs(5);
        assert_eq!((vnni.is_some(), bf16.is_some()), (u.vnni, u.bf16));
        assert!(vnni
            .into_iter()
            .chain(bf16)
            .all(|r| r > 0.0 && r.is_finite()));
    }

    /// The vector exp against f64 over its whole range (every ISA via `CSA2_ISA` in CI), plus the
    /// edges: 0 → 1 exactly, NaN stays NaN, the clamp below −87.3.
    #[test]
    fn exp_is_within_two_ulp() {
        let n = 1 << 16;
        let mut x: Vec<f32> = (0..n)
            .map(|i| expc::LO + (expc::HI - expc::LO) * i as f32 / (n - 1) as f32)
            .collect();
        x.extend([
            0.0,
            -0.0,
            1.0,
            -1.0,
            1e-8,
            -1e-8,
            f32::NAN,
            -1000.0,
            -1e30,
            0.5,
            -0.5,
        ]);
        x.resize(x.len().next_multiple_of(16), 0.0);
        let mut out = vec![0f32; x.len()];
        exp_mv(&x, &mut out);
        for (&a, &e) in x.iter().zip(&out) {
            if a.is_nan() {
                assert!(e.is_nan());
                continue;
            }
            let want = (a.max(expc::LO) as f64).exp();
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(
                ((e as f64) - want).abs() <= 2.0 * ulp as f64,
                "exp({a}) = {e}, want {want}"
            );
        }
        assert_eq!(out[n], 1.0);
    }
}
