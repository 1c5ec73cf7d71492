// Shared device helpers for every csa2 kernel: integer types, bf16 rounding, the bit-exact scalar
// codecs of docs/SPEC.md §1 (E2M1, E4M3, E8M0), block-planar page addressing and warp / block reductions.
//
// The kernels include no CUDA or C++ headers on purpose: the same flattened source compiles under
// nvcc (build time) and NVRTC (run-time fallback, see src/cuda/modules.rs) without include paths.
//
// Every codec here mirrors src/formats/scalar.rs line for line; the GPU tests compare the two bit
// for bit, so change both or neither.
#pragma once

// Model constants (src/geometry/consts.rs), record widths and ids (src/formats/abi.rs) and launch
// shapes (src/cuda/shapes.rs) come from build.rs as -D defines; the kernels write none of them as
// literals.
#if !defined(CSA2_KV_DIM) || !defined(CSA2_HEADS) || !defined(CSA2_KV_THREADS)
#error "compile the csa2 kernels through build.rs: it passes -D CSA2_<NAME> from src/geometry/consts.rs and src/cuda/shapes.rs"
#endif
#if !defined(CSA2_FMT_NVFP4) || !defined(CSA2_NVFP4_DATA) || !defined(CSA2_POOL_BLOCK_PLANAR)
#error "compile the csa2 kernels through build.rs: it passes the record widths and ids of src/formats/abi.rs as -D CSA2_<NAME>"
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

#define CSA2_FULL_MASK 0xffffffffu
#define CSA2_NEG_INF __int_as_float(0xff800000)
#define CSA2_POS_INF __int_as_float(0x7f800000)

// SM100 has hardware E2M1 conversion (cvt.rn.satfinite.e2m1x2.f32); SM90 does not and uses the
// software encoder. Both give identical codes (the sign bit and NaN are fixed up in software).
#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL)
#define CSA2_HW_E2M1 1
#endif

// ---- floats --------------------------------------------------------------------------------------

// 2^k as f32 for k in [-149, 127], exact (subnormal powers included).
__device__ __forceinline__ float csa2_pow2(int k) {
    return k >= -126 ? __int_as_float((k + 127) << 23) : __int_as_float(1 << (k + 149));
}

// Round to the nearest bf16 (ties to even) and back; NaN stays NaN (quieted), overflow goes to Inf.
__device__ __forceinline__ float bf16_round(float x) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(b | 0x00400000u);
    b += 0x7fffu + ((b >> 16) & 1u);
    return __uint_as_float(b & 0xffff0000u);
}

__device__ __forceinline__ u16 f32_to_bf16_bits(float x) {
    return (u16)(__float_as_uint(bf16_round(x)) >> 16);
}

__device__ __forceinline__ float bf16_bits_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

// IEEE half bits → f32, exact (subnormals included; NaN payload kept, as the host's `half`).
__device__ __forceinline__ float f16_bits_to_f32(u32 h) {
    u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * csa2_pow2(-24);
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// f32 → IEEE half bits, round to nearest even; overflow → ±Inf; NaN → quiet NaN with the top
// payload bits (the host's `half::f16::from_f32` bit for bit).
__device__ __forceinline__ u32 f32_to_f16_bits(float x) {
    u32 b = __float_as_uint(x), sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | ((a >> 13) & 0x3ffu);
    if (a >= 0x477ff000u) return sign | 0x7c00u;  // ≥ 65520 rounds past the largest half
    if (a >= 0x38800000u) {                       // a normal half (≥ 2^-14)
        u32 r = a - 0x38000000u;                  // exponent rebiased by -112
        r += 0xfffu + ((r >> 13) & 1u);
        return sign | (r >> 13);
    }
    // A half subnormal or zero: x · 2^24 to the nearest even integer (1024 is the smallest normal).
    return sign | (u32)rintf(__uint_as_float(a) * 16777216.0f);
}

// Element `i` of a float tensor whose type is a launch parameter (CSA2_DTYPE_*), as f32 (exact).
__device__ __forceinline__ float load_float(const void* p, int dtype, i64 i) {
    if (dtype == CSA2_DTYPE_BF16) return bf16_bits_to_f32(((const u16*)p)[i]);
    if (dtype == CSA2_DTYPE_F16) return f16_bits_to_f32(((const u16*)p)[i]);
    return ((const float*)p)[i];
}

// Stores `v` as element `i` of a float tensor of type `dtype` (rounded to nearest even).
__device__ __forceinline__ void store_float(void* p, int dtype, i64 i, float v) {
    if (dtype == CSA2_DTYPE_BF16) ((u16*)p)[i] = f32_to_bf16_bits(v);
    else if (dtype == CSA2_DTYPE_F16) ((u16*)p)[i] = (u16)f32_to_f16_bits(v);
    else ((float*)p)[i] = v;
}

// Clamp that keeps NaN (fminf / fmaxf would replace it by a bound; the CPU clamp keeps it).
__device__ __forceinline__ float clamp_keep_nan(float x, float lo, float hi) {
    return x < lo ? lo : (x > hi ? hi : x);
}

// ceil(log2(v)) exactly from the bits (docs/SPEC.md §1). v <= 0 → -150, +Inf → 128; NaN → 128 (callers
// clamp to 127, as the CPU's `unwrap_or(127)`).
__device__ __forceinline__ int ceil_log2(float v) {
    if (v != v) return 128;
    if (v <= 0.0f) return -150;
    u32 b = __float_as_uint(v);
    int e = (int)((b >> 23) & 0xff);
    u32 m = b & 0x7fffffu;
    if (e == 0xff) return 128;
    if (e == 0) {
        int fl = 31 - __clz((int)m) - 149;
        return (m & (m - 1)) == 0 ? fl : fl + 1;
    }
    return e - 127 + (m != 0 ? 1 : 0);
}

// ---- E2M1 ----------------------------------------------------------------------------------------

// Software encoder: RNE on {0,.5,1,1.5,2,3,4,6}; |x|>6, ±Inf → ±6; NaN → 0x7; -0 and negative
// values rounding to zero keep the sign (0x8).
__device__ __forceinline__ u32 e2m1_encode_sw(float x) {
    if (x != x) return 0x7;
    u32 sign = (__float_as_uint(x) >> 31) << 3;
    float a = fabsf(x);
    u32 c = a <= 0.25f ? 0 : a < 0.75f ? 1 : a <= 1.25f ? 2 : a < 1.75f ? 3
          : a <= 2.5f ? 4 : a < 3.5f ? 5 : a <= 5.0f ? 6 : 7;
    return sign | c;
}

// Two E2M1 codes packed: `lo` (element 2i) in the low nibble, `hi` (element 2i+1) in the high one.
__device__ __forceinline__ u32 e2m1_pack2(float lo, float hi) {
#ifdef CSA2_HW_E2M1
    // The hardware rounds the magnitude (RNE, satfinite); sign and NaN follow the CPU rule.
    float l = (lo != lo) ? 6.0f : lo, h = (hi != hi) ? 6.0f : hi;
    u32 r;
#ifdef CSA2_SIMT_HOST
    r = csa2_simt::cvt_rn_satfinite_e2m1x2_f32(h, l);  // the host SIMT harness's emulation
#else
    asm("{\n\t.reg .b8 t;\n\tcvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n\tcvt.u32.u8 %0, t;\n\t}"
        : "=r"(r)
        : "f"(h), "f"(l));
#endif
    u32 ls = (lo == lo) ? (__float_as_uint(lo) >> 31) : 0u;
    u32 hs = (hi == hi) ? (__float_as_uint(hi) >> 31) : 0u;
    return (r & 0x77u) | (ls << 3) | (hs << 7);
#else
    return e2m1_encode_sw(lo) | (e2m1_encode_sw(hi) << 4);
#endif
}

__device__ __forceinline__ float e2m1_decode(u32 code) {
    u32 c = code & 7u;
    float m = c < 2 ? 0.5f * (float)c : (1.0f + 0.5f * (float)(c & 1u)) * csa2_pow2((int)(c >> 1) - 1);
    return (code & 8u) ? -m : m;
}

// ---- E4M3 (OCP fn, saturating) -----------------------------------------------------------------------

__device__ __forceinline__ u32 e4m3_encode(float x) {
    if (x != x) return 0x7f;
    u32 sign = (__float_as_uint(x) >> 31) << 7;
    float a = fabsf(x);
    if (a >= 448.0f) return sign | 0x7e;
    int e = (int)((__float_as_uint(a) >> 23) & 0xff) - 127;
    int ee = e < -6 ? -6 : e;
    int q = (int)rintf(a * csa2_pow2(3 - ee));
    return sign | (u32)((ee + 6) * 8 + q);
}

__device__ __forceinline__ float e4m3_decode(u32 b) {
    u32 ex = (b >> 3) & 0xf, man = b & 7;
    float m;
    if (ex == 15 && man == 7) m = __int_as_float(0x7fc00000);
    else if (ex == 0) m = (float)man * csa2_pow2(-9);
    else m = (float)(8 + man) * csa2_pow2((int)ex - 10);
    return (b & 0x80) ? -m : m;
}

// ---- E8M0 ----------------------------------------------------------------------------------------

__device__ __forceinline__ float e8m0_decode(u32 b) {
    return b == 0xff ? __int_as_float(0x7fc00000) : csa2_pow2((int)b - 127);
}

// ---- reductions ----------------------------------------------------------------------------------

// Butterfly max over `width` lanes (a power of two ≤ 32). fmaxf drops NaN, as the CPU amax does.
__device__ __forceinline__ float group_max(float v, int width) {
    for (int o = width / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(CSA2_FULL_MASK, v, o));
    return v;
}

// Warp sum; every lane returns lane 0's result so all lanes agree bit for bit.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(CSA2_FULL_MASK, v, o);
    return __shfl_sync(CSA2_FULL_MASK, v, 0);
}

// Block sum for blockDim.x a multiple of 32 (≤ 1024). `scratch` holds 32 floats. Deterministic:
// warp partials are added in warp order by one thread. Ends with a barrier; all threads get it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < nw; ++w) s += scratch[w];
        scratch[0] = s;
    }
    __syncthreads();
    float r = scratch[0];
    __syncthreads();
    return r;
}

// ---- page pools (docs/SPEC.md §1, src/ops/attention/pools.rs) -------------------------------------------

// Data and scale addresses of one state (record) in a pool.
struct SlotPtr {
    u8* data;
    u8* scale;
};

// How a pool's pages hold their records (src/ops/attention/pools.rs::PoolLayout; the ids
// CSA2_POOL_INTERLEAVED / CSA2_POOL_BLOCK_PLANAR come from src/formats/abi.rs):
// interleaved = a state's scales follow its own data (vLLM's V4.1 NVFP4 and MXFP8 records);
// block-planar = all data of the page, then all scales (V4 record, index K, csa2's own pages).

// Address of `slot` (page = slot / states, state = slot % states) in a strided pool whose pages
// are `block_stride` bytes apart — vLLM's per-block slab size, read from the tensor's stride(0),
// never states · record bytes.
__device__ __forceinline__ SlotPtr pool_slot_ptr(u8* pool, i64 block_stride, i64 slot, int states,
                                                 int data_bytes, int scale_bytes, int layout) {
    i64 page = slot / states, off = slot % states;
    u8* base = pool + page * block_stride;
    SlotPtr p;
    if (layout == CSA2_POOL_INTERLEAVED) {
        p.data = base + off * (i64)(data_bytes + scale_bytes);
        p.scale = p.data + data_bytes;
    } else {
        p.data = base + off * data_bytes;
        p.scale = base + (i64)states * data_bytes + off * scale_bytes;
    }
    return p;
}

// csa2's own dense block-planar pages (the cache manager's pools): pages back to back.
__device__ __forceinline__ SlotPtr slot_ptr(u8* pool, i64 slot, int page_slots, int data_bytes,
                                            int scale_bytes) {
    return pool_slot_ptr(pool, (i64)page_slots * (data_bytes + scale_bytes), slot, page_slots,
                         data_bytes, scale_bytes, CSA2_POOL_BLOCK_PLANAR);
}

// Physical slot of logical row `j` through a block table row, or -1 when unmapped.
__device__ __forceinline__ i64 table_slot(const i32* bt_row, int max_blocks, i64 j, int page_slots) {
    if (j < 0) return -1;
    i64 b = j / page_slots;
    if (b >= max_blocks) return -1;
    i32 blk = bt_row[b];
    if (blk < 0) return -1;
    return (i64)blk * page_slots + j % page_slots;
}

// ---- record formats (docs/SPEC.md §1; src/formats/records.rs) ---------------------------------------

// The Csa2Format ids the kernels switch on (CSA2_FMT_NVFP4, _MXFP4_INDEX, _MXFP8, _V4) and the
// data / scale bytes of each record (CSA2_<RECORD>_DATA / _SCALE; CSA2_NOPE_DIM) come from
// src/formats/abi.rs: NVFP4-DS main KV (E2M1 pairs, one E4M3 per 16), MXFP4 index K (E2M1 pairs,
// one UE8M0 per 32), MXFP8 SWA (E4M3, one UE8M0 per 32), V4 (NoPE E4M3 + RoPE bf16, one UE8M0 per
// 64 NoPE dims, then a pad byte).

__device__ __forceinline__ int fmt_data_bytes(int fmt) {
    return fmt == CSA2_FMT_NVFP4 ? CSA2_NVFP4_DATA : fmt == CSA2_FMT_MXFP8 ? CSA2_MXFP8_DATA : CSA2_V4_DATA;
}
__device__ __forceinline__ int fmt_scale_bytes(int fmt) {
    return fmt == CSA2_FMT_NVFP4 ? CSA2_NVFP4_SCALE : fmt == CSA2_FMT_MXFP8 ? CSA2_MXFP8_SCALE : CSA2_V4_SCALE;
}

// ---- record decode, 32 dims at a time: dims [32c, 32c + 32) of one latent record into `dst` ---------
// (exact: every E2M1·E4M3, E4M3·2^e and bf16 value is an f32). One function per record kind; the
// attention kernels call them, by format or directly.

// NVFP4-DS: 256 B E2M1 pairs (even element low), 32 E4M3 scales per 16.
__device__ __forceinline__ void nvfp4_dequant32(SlotPtr sp, int c, float* dst) {
    float s0 = e4m3_decode(sp.scale[2 * c]), s1 = e4m3_decode(sp.scale[2 * c + 1]);
    const u8* d = sp.data + 16 * c;
    for (int i = 0; i < 16; ++i) {
        u32 b = d[i];
        float s = i < 8 ? s0 : s1;
        dst[2 * i] = e2m1_decode(b & 0xf) * s;
        dst[2 * i + 1] = e2m1_decode(b >> 4) * s;
    }
}

// MXFP8: 512 E4M3, 16 UE8M0 per 32.
__device__ __forceinline__ void mxfp8_dequant32(SlotPtr sp, int c, float* dst) {
    float s = e8m0_decode(sp.scale[c]);
    const u8* d = sp.data + 32 * c;
    for (int i = 0; i < 32; ++i) dst[i] = e4m3_decode(d[i]) * s;
}

// V4: 448 E4M3 NoPE dims with 7 UE8M0 per 64, then dims 448..511 as bf16 (little-endian) at byte
// 448 + 2·(dim − 448).
__device__ __forceinline__ void v4_dequant32(SlotPtr sp, int c, float* dst) {
    if (c < CSA2_NOPE_DIM / 32) {
        float s = e8m0_decode(sp.scale[c / 2]);
        const u8* d = sp.data + 32 * c;
        for (int i = 0; i < 32; ++i) dst[i] = e4m3_decode(d[i]) * s;
    } else {
        const u8* d = sp.data + CSA2_NOPE_DIM + 64 * (c - CSA2_NOPE_DIM / 32);
        for (int i = 0; i < 32; ++i) dst[i] = bf16_bits_to_f32((u16)(d[2 * i] | (d[2 * i + 1] << 8)));
    }
}

// The record at `sp` in format `fmt` (NVFP4-DS, MXFP8 or V4).
__device__ __forceinline__ void dequant32(SlotPtr sp, int fmt, int c, float* dst) {
    if (fmt == CSA2_FMT_NVFP4) nvfp4_dequant32(sp, c, dst);
    else if (fmt == CSA2_FMT_MXFP8) mxfp8_dequant32(sp, c, dst);
    else v4_dequant32(sp, c, dst);
}

// ---- record codecs, one warp per row (lane i holds values [4i, 4i+4) of each 128-value chunk) ------

// NVFP4-DS main KV (docs/SPEC.md §1): KV_DIM values; per 16: s = E4M3(clamp(amax/6, 2^-9, 448)),
// q = E2M1(x / s) with a correctly rounded division.
__device__ __forceinline__ void warp_encode_nvfp4(const float* row, u8* data, u8* scale) {
    int lane = threadIdx.x & 31;
    for (int it = 0; it < CSA2_KV_DIM / 128; ++it) {
        int base = it * 128 + lane * 4;
        float v[4];
        float a = 0.0f;
        for (int k = 0; k < 4; ++k) {
            v[k] = bf16_round(row[base + k]);
            a = fmaxf(a, fabsf(v[k]));
        }
        a = group_max(a, 4);
        u32 sb = e4m3_encode(clamp_keep_nan(__fdiv_rn(a, 6.0f), csa2_pow2(-9), 448.0f));
        float s = e4m3_decode(sb);
        u32 b0 = e2m1_pack2(__fdiv_rn(v[0], s), __fdiv_rn(v[1], s));
        u32 b1 = e2m1_pack2(__fdiv_rn(v[2], s), __fdiv_rn(v[3], s));
        *(u16*)(data + base / 2) = (u16)(b0 | (b1 << 8));
        if ((lane & 3) == 0) scale[base / 16] = (u8)sb;
    }
}

// DeepSeek MXFP4 (docs/SPEC.md §1): `chunks` × 128 values; per 32: e = clamp(ceil(log2(max(amax,
// 6·2^-126)/6)), -127, 127); q = E2M1(x · 2^-e).
__device__ __forceinline__ void warp_encode_mxfp4(const float* row, int chunks, u8* data, u8* scale) {
    int lane = threadIdx.x & 31;
    for (int it = 0; it < chunks; ++it) {
        int base = it * 128 + lane * 4;
        float v[4];
        float a = 0.0f;
        for (int k = 0; k < 4; ++k) {
            v[k] = bf16_round(row[base + k]);
            a = fmaxf(a, fabsf(v[k]));
        }
        a = fmaxf(group_max(a, 8), 6.0f * csa2_pow2(-126));
        int e = ceil_log2(__fdiv_rn(a, 6.0f));
        e = e < -127 ? -127 : (e > 127 ? 127 : e);
        float inv = csa2_pow2(-e);
        u32 b0 = e2m1_pack2(v[0] * inv, v[1] * inv);
        u32 b1 = e2m1_pack2(v[2] * inv, v[3] * inv);
        *(u16*)(data + base / 2) = (u16)(b0 | (b1 << 8));
        if ((lane & 7) == 0) scale[base / 32] = (u8)(e + 127);
    }
}

// MXFP8 (docs/SPEC.md §1): KV_DIM values; per 32: amax floored at 1e-4, e = ceil(log2(amax/448)),
// q = E4M3(clamp(x · 2^-e, ±448)).
__device__ __forceinline__ void warp_encode_mxfp8(const float* row, u8* data, u8* scale) {
    int lane = threadIdx.x & 31;
    for (int it = 0; it < CSA2_KV_DIM / 128; ++it) {
        int base = it * 128 + lane * 4;
        float v[4];
        float a = 0.0f;
        for (int k = 0; k < 4; ++k) {
            v[k] = bf16_round(row[base + k]);
            a = fmaxf(a, fabsf(v[k]));
        }
        a = fmaxf(group_max(a, 8), 1e-4f);
        int e = ceil_log2(__fdiv_rn(a, 448.0f));
        e = e < -127 ? -127 : (e > 127 ? 127 : e);
        float inv = csa2_pow2(-e);
        u32 w = 0;
        for (int k = 0; k < 4; ++k) w |= e4m3_encode(clamp_keep_nan(v[k] * inv, -448.0f, 448.0f)) << (8 * k);
        *(u32*)(data + base) = w;
        if ((lane & 7) == 0) scale[base / 32] = (u8)(e + 127);
    }
}
