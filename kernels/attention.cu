// Sparse decode attention reading NVFP4-DS main KV and MXFP8 SWA records straight from the pages
// (docs/SPEC.md §2 "Attention").
//
// For query row t (position p = pos[t], request r = req[t]) and head h:
//   keys = { main-KV entry topk[t, i] : i < topk_len, index ≥ 0 and mapped }   (-1 = masked)
//        ∪ { SWA token q : max(p − 127, 0, window_start[t]) ≤ q ≤ p, mapped }
//   z_k = scale · (q_h · kv_k);  K = V = the dequantized latent
//   out_h = Σ_k e^{z_k − M} kv_k / (Σ_k e^{z_k − M} + e^{sink_h − M}),  M = max(max_k z_k, sink_h)
//   lse_h = log Σ_k e^{z_k}   (natural log, without the sink; -Inf when no key is visible)
// A row with no visible key outputs zeros. With inv_freq given, the output's dims 448..511 get the
// inverse RoPE at p (GPT-J interleaved pairs, angle −p·freq_i).
//
// Work split: one block per (token, group of 16 heads); 256 threads; thread (h = tid / 16,
// part = tid % 16) owns dims {i·16 + part : i < 32} of head h's query and output (conflict-free
// shared-memory reads: the 16 parts of a head read 16 consecutive floats). Keys are dequantized
// 16 at a time into shared memory (f32, exact: every E2M1·E4M3 and E4M3·2^e product is an f32).
// Launch: grid = (4, T), block = 256.
#include "common.cuh"

// Dims, heads and window from the geometry (build.rs defines); the tiles below are built for them.
#define D CSA2_KV_DIM
#define HEADS CSA2_HEADS
#define GROUP CSA2_ATTN_HEADS_PER_BLOCK
#define PARTS (CSA2_ATTN_THREADS / GROUP)
#define PER (D / PARTS)
#define KT 16
#define WINDOW CSA2_WINDOW
// The dequantizing split gives each thread 32 dims of one key: KT keys × D / 32 chunks = a block.
#if KT * (D / 32) != CSA2_ATTN_THREADS || PARTS > 32 || D % PARTS != 0
#error "attention tiles: KT · D / 32 must equal the block's threads, and a head's parts fit one warp"
#endif

// ---- shared by the f32 kernels: one tile of KT keys for head h, and the sink -------------------

// Scores of the tile's keys for head h (reduced over the PARTS threads of the head, broadcast from
// the group leader) and the online-softmax update of (m, l, o). ks holds the dequantized keys,
// slot_s[kk] < 0 marks a missing key; z_s is this block's score scratch.
__device__ __forceinline__ void f32_tile_update(const float (*ks)[D], const i64* slot_s, float (*z_s)[KT],
                                                const float* qr, float* o, float& m, float& l, int k0,
                                                int n_keys, float scale) {
    int tid = threadIdx.x, hl = tid / PARTS, part = tid % PARTS;
    // Group leader lane within the warp (PARTS threads per head, 32 / PARTS heads per warp).
    int leader = (tid & 31) & ~(PARTS - 1);
    float tmax = CSA2_NEG_INF;
#pragma unroll 1
    for (int kk = 0; kk < KT; ++kk) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) acc += qr[i] * ks[kk][i * PARTS + part];
        for (int off = PARTS / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(CSA2_FULL_MASK, acc, off);
        acc = __shfl_sync(CSA2_FULL_MASK, acc, leader);
        bool valid = (k0 + kk) < n_keys && slot_s[kk] >= 0;
        float zk = valid ? acc * scale : CSA2_NEG_INF;
        if (part == 0) z_s[hl][kk] = zk;
        tmax = fmaxf(tmax, zk);
    }
    __syncwarp();
    if (tmax == CSA2_NEG_INF) return;
    float m_new = fmaxf(m, tmax);
    float corr = expf(m - m_new);  // m = -Inf → 0
    l *= corr;
#pragma unroll
    for (int i = 0; i < PER; ++i) o[i] *= corr;
#pragma unroll 1
    for (int kk = 0; kk < KT; ++kk) {
        float pk = expf(z_s[hl][kk] - m_new);
        l += pk;
#pragma unroll
        for (int i = 0; i < PER; ++i) o[i] += pk * ks[kk][i * PARTS + part];
    }
    m = m_new;
}

// The output factor of a head with running max m (finite) and sum l: the sink sk enters the
// denominator only (sk = -Inf: no sink).
__device__ __forceinline__ float sink_factor(float m, float l, float sk) {
    float M = fmaxf(m, sk);
    float a = expf(m - M);
    return a / (l * a + expf(sk - M));
}

// Applies the sink to a finished head (empty rows stay zero) and returns its lse (-Inf if empty).
__device__ __forceinline__ float f32_finish(float* o, float m, float l, float sk) {
    if (m == CSA2_NEG_INF) return CSA2_NEG_INF;
    float f = sink_factor(m, l, sk);
#pragma unroll
    for (int i = 0; i < PER; ++i) o[i] *= f;
    return m + logf(l);
}

extern "C" __global__ void __launch_bounds__(CSA2_ATTN_THREADS, 1) sparse_decode_attn_f32(
    const float* __restrict__ q, const i32* __restrict__ topk, int topk_len, const i32* __restrict__ pos,
    const i32* __restrict__ req, const i32* __restrict__ window_start, const u8* __restrict__ main_pages,
    const i32* __restrict__ main_bt, int main_max_blocks, int main_page_slots, const u8* __restrict__ swa_pages,
    const i32* __restrict__ swa_bt, int swa_max_blocks, int swa_page_slots, const float* __restrict__ sink,
    const double* __restrict__ inv_freq, float scale, float* __restrict__ out, float* __restrict__ lse) {
    __shared__ float ks[KT][D];
    __shared__ i64 slot_s[KT];
    __shared__ int kind_s[KT];
    __shared__ float z_s[GROUP][KT];
    int t = blockIdx.y, tid = threadIdx.x;
    int hl = tid / PARTS, part = tid % PARTS, h = blockIdx.x * GROUP + hl;
    i64 p = pos[t];
    int r = req[t];
    i64 ws = window_start[t];
    i64 w_lo = p - (WINDOW - 1);
    if (w_lo < 0) w_lo = 0;
    if (w_lo < ws) w_lo = ws;
    int n_win = p >= w_lo ? (int)(p - w_lo + 1) : 0;
    int n_keys = topk_len + n_win;

    float qr[PER], o[PER];
    const float* qh = q + ((i64)t * HEADS + h) * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        qr[i] = qh[i * PARTS + part];
        o[i] = 0.0f;
    }
    float m = CSA2_NEG_INF, l = 0.0f;

    for (int k0 = 0; k0 < n_keys; k0 += KT) {
        __syncthreads();
        if (tid < KT) {
            int k = k0 + tid;
            i64 slot = -1;
            int kind = 0;
            if (k < topk_len) {
                i32 j = topk[(i64)t * topk_len + k];
                slot = table_slot(main_bt + (i64)r * main_max_blocks, main_max_blocks, j, main_page_slots);
                kind = 0;
            } else if (k < n_keys) {
                slot = table_slot(swa_bt + (i64)r * swa_max_blocks, swa_max_blocks, w_lo + (k - topk_len),
                                  swa_page_slots);
                kind = 1;
            }
            slot_s[tid] = slot;
            kind_s[tid] = kind;
        }
        __syncthreads();
        // Dequantize: thread (key = tid / 16, c = tid % 16) fills dims [32c, 32c + 32) of its key.
        {
            int kk = tid / 16, c = tid % 16;
            i64 slot = slot_s[kk];
            float* dst = &ks[kk][32 * c];
            if (slot < 0) {
                for (int i = 0; i < 32; ++i) dst[i] = 0.0f;
            } else if (kind_s[kk] == 0) {
                nvfp4_dequant32(slot_ptr((u8*)main_pages, slot, main_page_slots, CSA2_NVFP4_DATA, CSA2_NVFP4_SCALE),
                                c, dst);
            } else {
                mxfp8_dequant32(slot_ptr((u8*)swa_pages, slot, swa_page_slots, CSA2_MXFP8_DATA, CSA2_MXFP8_SCALE),
                                c, dst);
            }
        }
        __syncthreads();
        f32_tile_update(ks, slot_s, z_s, qr, o, m, l, k0, n_keys, scale);
    }

    // Sink in the denominator only; empty rows stay zero.
    float lse_h = f32_finish(o, m, l, sink ? sink[h] : CSA2_NEG_INF);
    __syncthreads();
    // Stage the GROUP heads' outputs through shared memory (ks is exactly KT × D) for the inverse RoPE.
#pragma unroll
    for (int i = 0; i < PER; ++i) ks[hl][i * PARTS + part] = o[i];
    __syncthreads();
    float* oh = out + ((i64)t * HEADS + blockIdx.x * GROUP) * D;
    for (int idx = tid; idx < GROUP * D; idx += CSA2_ATTN_THREADS) {
        int hh = idx / D, d = idx % D;
        float v = ks[hh][d];
        if (inv_freq && d >= CSA2_NOPE_DIM) {
            int pi = (d - CSA2_NOPE_DIM) / 2;
            double ang = (double)p * inv_freq[pi];
            float c = (float)cos(ang), s = (float)sin(ang);
            float a = ks[hh][CSA2_NOPE_DIM + 2 * pi], b = ks[hh][CSA2_NOPE_DIM + 1 + 2 * pi];
            v = (d & 1) == 0 ? a * c + b * s : -a * s + b * c;
        }
        oh[(i64)hh * D + d] = v;
    }
    if (part == 0) lse[(i64)t * HEADS + h] = lse_h;
}

// ---- attention over vLLM's strided page pools (src/ops/attention/pools.rs) ----------------------
//
// FlashMLA's sparse contract: per token t, the compressed entries main_idx[t, :main_len[t]] then
// the SWA slots swa_idx[t, :swa_len[t]] (global slots page · states + state; −1 = none), one
// softmax per local head with the sink in the denominator. q / out bf16 [T, hp, 512] (hp = 64 or
// 128 padded heads; heads ≥ n_heads are written as zeros); lse f32 [T, n_heads] or null; sink f32
// [n_heads] or null. A pool is (base, block_stride bytes, states per page, blocks, Csa2Format,
// layout); main_pool null = SWA-only layer. A slot outside −1..blocks·states is skipped and
// recorded once in err[4] = {1 compressed | 2 SWA, token, column, slot} (first writer wins; the
// caller zeroes err and reads it whenever it syncs). Raw pointers only, no host access, no
// allocation: capturable in a CUDA graph.
//
// Work split as in sparse_decode_attn_f32: grid = (hp / 16, T), block = 256, thread (h = tid / 16,
// part = tid % 16) owns dims {i·16 + part} of head h; keys are dequantized 16 at a time into
// shared memory (exact f32 images of the records).

// One strided pool as the kernels' arguments give it.
struct Pool {
    const u8* base;
    i64 stride;
    int states;
    int fmt;
    int layout;
};

// The arguments of both pool kernels: one ABI, pushed in this order by
// src/ops/attention/cuda.rs::attention_pools_launch whichever kernel it picks.
#define ATTN_POOLS_ARGS                                                                                  \
    const u16 *__restrict__ q, int hp, int n_heads, const i32 *__restrict__ main_idx, int km,             \
        const i32 *__restrict__ main_len, const u8 *__restrict__ main_pool, i64 main_stride,               \
        int main_states, i64 main_blocks, int main_fmt, int main_layout, const i32 *__restrict__ swa_idx,  \
        int ks, const i32 *__restrict__ swa_len, const u8 *__restrict__ swa_pool, i64 swa_stride,          \
        int swa_states, i64 swa_blocks, int swa_fmt, int swa_layout, const float *__restrict__ sink,       \
        float scale, u16 *__restrict__ out, float *__restrict__ lse, i32 *__restrict__ err

// A per-token length: len[t] (or `cap` without a length array), clamped to 0..cap.
__device__ __forceinline__ int clamp_len(const i32* len, int t, int cap) {
    int n = len ? len[t] : cap;
    return n < 0 ? 0 : (n > cap ? cap : n);
}

// Token t's keys in the two pools: the first nm are main_idx[t, :nm], then swa_idx[t, :n_keys − nm];
// a slot must lie in −1..cap of its pool.
struct PoolsRow {
    int nm, n_keys;
    i64 main_cap, swa_cap;
    Pool mp, sp;
};

__device__ __forceinline__ PoolsRow pools_row(int t, int km, const i32* main_len, const u8* main_pool,
                                              i64 main_stride, int main_states, i64 main_blocks, int main_fmt,
                                              int main_layout, int ks, const i32* swa_len, const u8* swa_pool,
                                              i64 swa_stride, int swa_states, i64 swa_blocks, int swa_fmt,
                                              int swa_layout) {
    PoolsRow r;
    r.nm = clamp_len(main_len, t, km);
    r.n_keys = r.nm + clamp_len(swa_len, t, ks);
    r.main_cap = main_pool ? main_blocks * (i64)main_states : 0;
    r.swa_cap = swa_blocks * (i64)swa_states;
    r.mp = {main_pool, main_stride, main_states, main_fmt, main_layout};
    r.sp = {swa_pool, swa_stride, swa_states, swa_fmt, swa_layout};
    return r;
}

// The row of the kernel's own arguments (inside a pool kernel).
#define POOLS_ROW(t)                                                                                    \
    pools_row(t, km, main_len, main_pool, main_stride, main_states, main_blocks, main_fmt, main_layout, \
              ks, swa_len, swa_pool, swa_stride, swa_states, swa_blocks, swa_fmt, swa_layout)

// Slot and kind (1 compressed, 2 SWA, 0 past the keys) of key k of row `pr`. A slot outside its
// pool is recorded in err (first writer wins) and becomes −1 (skipped).
__device__ __forceinline__ void pools_key_slot(int t, int k, const PoolsRow& pr, const i32* main_idx, int km,
                                               const i32* swa_idx, int ks, i32* err, i64* slot_out,
                                               int* kind_out) {
    int nm = pr.nm, n_keys = pr.n_keys;
    i64 main_cap = pr.main_cap, swa_cap = pr.swa_cap;
    i64 slot = -1;
    int kind = 0, col = 0;
    i64 cap = 0;
    if (k < nm) {
        col = k;
        slot = main_idx[(i64)t * km + col];
        kind = 1;
        cap = main_cap;
    } else if (k < n_keys) {
        col = k - nm;
        slot = swa_idx[(i64)t * ks + col];
        kind = 2;
        cap = swa_cap;
    }
    if (kind != 0 && slot != -1 && (slot < -1 || slot >= cap)) {
        if (err && atomicCAS(&err[0], 0, kind) == 0) {
            err[1] = t;
            err[2] = col;
            err[3] = (i32)slot;
        }
        slot = -1;
    }
    *slot_out = slot;
    *kind_out = kind;
}

// Dims [32c, 32c + 32) of the record at `slot` of pool p.
__device__ __forceinline__ void pool_dequant32(const Pool& p, i64 slot, int c, float* dst) {
    dequant32(pool_slot_ptr((u8*)p.base, p.stride, slot, p.states, fmt_data_bytes(p.fmt), fmt_scale_bytes(p.fmt),
                            p.layout),
              p.fmt, c, dst);
}

// Dims [32c, 32c + 32) of a key from the pool its kind names (1 compressed, 2 SWA); zeros for a
// missing one (slot < 0).
__device__ __forceinline__ void pools_dequant32(i64 slot, int kind, int c, const Pool& mp, const Pool& sp,
                                                float* dst) {
    if (slot < 0) {
        for (int i = 0; i < 32; ++i) dst[i] = 0.0f;
    } else if (kind == 1) {
        pool_dequant32(mp, slot, c, dst);
    } else {
        pool_dequant32(sp, slot, c, dst);
    }
}

extern "C" __global__ void __launch_bounds__(CSA2_ATTN_THREADS, 1) attn_pools_bf16(ATTN_POOLS_ARGS) {
    __shared__ float ks_s[KT][D];
    __shared__ i64 slot_s[KT];
    __shared__ int kind_s[KT];
    __shared__ float z_s[GROUP][KT];
    int t = blockIdx.y, tid = threadIdx.x;
    int hl = tid / PARTS, part = tid % PARTS, h = blockIdx.x * GROUP + hl;
    PoolsRow pr = POOLS_ROW(t);
    int n_keys = pr.n_keys;
    bool live = h < n_heads;

    float qr[PER], o[PER];
    const u16* qh = q + ((i64)t * hp + h) * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        qr[i] = live ? bf16_bits_to_f32(qh[i * PARTS + part]) : 0.0f;
        o[i] = 0.0f;
    }
    float m = CSA2_NEG_INF, l = 0.0f;

    for (int k0 = 0; k0 < n_keys; k0 += KT) {
        __syncthreads();
        if (tid < KT)
            pools_key_slot(t, k0 + tid, pr, main_idx, km, swa_idx, ks, err, &slot_s[tid], &kind_s[tid]);
        __syncthreads();
        {
            int kk = tid / 16, c = tid % 16;
            pools_dequant32(slot_s[kk], kind_s[kk], c, pr.mp, pr.sp, &ks_s[kk][32 * c]);
        }
        __syncthreads();
        f32_tile_update(ks_s, slot_s, z_s, qr, o, m, l, k0, n_keys, scale);
    }

    float lse_h = f32_finish(o, m, l, (sink && live) ? sink[h] : CSA2_NEG_INF);
    u16* oh = out + ((i64)t * hp + h) * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) oh[i * PARTS + part] = live ? f32_to_bf16_bits(o[i]) : (u16)0;
    if (part == 0 && live && lse) lse[(i64)t * n_heads + h] = lse_h;
}

// ---- tensor-core variant of attn_pools_bf16 (same arguments and results, bf16 MMA) --------------
//
// Selected with CSA2_ATTENTION_KERNEL=mma (src/ops/attention/cuda.rs). One block per (token, 64
// padded heads); 8 warps: warp w owns heads 16·(w % 4) .. +16 and output dims 256·(w / 4) .. +256.
// Per tile of 16 keys (dequantized exactly into shared memory as bf16: every NVFP4 / MXFP8 / V4
// value is a bf16), S = Q·Kᵀ (16 heads × 16 keys, mma.sync m16n8k16 bf16 → f32 over 512 dims; the
// two dim-half warps of a head tile compute it twice rather than exchange it), an online softmax
// in f32 on the accumulator fragments, then O += P·V with P rounded to bf16 (as the CPU's bf16-dot
// path; tolerance BF16_DOTS_VS_F64). Fragment layouts: PTX ISA "Matrix fragments for mma.m16n8k16"
// (A row-major 16×16: a0 = (g, 2t..2t+1), a1 = (g+8, ·), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..);
// B col-major 16×8: b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g); C: c0,c1 = (g, 2t..2t+1),
// c2,c3 = (g+8, ·); g = lane / 4, t = lane % 4; the lower half-word holds the lower index).

#define TC_KT 16
#define TC_KS (D + 8)     // bf16 row stride of the key tile (pads rows onto different banks)
#define TC_NT (D / 2 / 8)  // n-tiles of 8 output dims per warp (a warp owns half the dims)
// The warp layout: 4 head tiles of 16 × 2 dim halves = 8 warps.
#if CSA2_ATTN_MMA_HEADS_PER_BLOCK != 4 * 16 || CSA2_ATTN_THREADS != 8 * 32
#error "attn_pools_bf16_mma: its warp layout is 4 head tiles of 16 by 2 dim halves"
#endif

__device__ __forceinline__ void mma_bf16_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                               u32 b1) {
#ifdef CSA2_SIMT_HOST
    // The host SIMT harness emulates the instruction from the PTX ISA's fragment tables.
    csa2_simt::mma_m16n8k16_bf16_f32(c, a0, a1, a2, a3, b0, b1);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)f32_to_bf16_bits(lo) | ((u32)f32_to_bf16_bits(hi) << 16);
}

extern "C" __global__ void __launch_bounds__(CSA2_ATTN_THREADS, 1) attn_pools_bf16_mma(ATTN_POOLS_ARGS) {
    __shared__ __align__(16) u16 kt[TC_KT * TC_KS];
    __shared__ i64 slot_s[TC_KT];
    __shared__ int kind_s[TC_KT];
    int t = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, tg = lane & 3;
    int h0 = blockIdx.x * CSA2_ATTN_MMA_HEADS_PER_BLOCK + (warp & 3) * 16;  // first head of this warp's tile
    int d0 = (warp >> 2) * (D / 2);                                        // first output dim of this warp
    PoolsRow pr = POOLS_ROW(t);
    int n_keys = pr.n_keys;
    // Rows g and g + 8 of the head tile; heads past hp do not exist (hp is 64 or 128).
    const u16* q0 = q + ((i64)t * hp + h0 + g) * D;
    const u16* q1 = q0 + 8 * D;
    float o[TC_NT][4];
#pragma unroll
    for (int n = 0; n < TC_NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = CSA2_NEG_INF, m1 = CSA2_NEG_INF, l0 = 0.0f, l1 = 0.0f;

    for (int k0 = 0; k0 < n_keys; k0 += TC_KT) {
        __syncthreads();
        if (tid < TC_KT)
            pools_key_slot(t, k0 + tid, pr, main_idx, km, swa_idx, ks, err, &slot_s[tid], &kind_s[tid]);
        __syncthreads();
        {
            int kk = tid / 16, c = tid % 16;
            float f[32];  // this thread's 32 dims of its key, then converted to bf16 (exact)
            pools_dequant32(slot_s[kk], kind_s[kk], c, pr.mp, pr.sp, f);
            u16* dst = kt + kk * TC_KS + 32 * c;
            for (int i = 0; i < 32; ++i) dst[i] = f32_to_bf16_bits(f[i]);
        }
        __syncthreads();
        // S = Q Kᵀ for keys k0 .. k0 + 16 (two n-tiles of 8 keys).
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll 4
        for (int kd = 0; kd < D; kd += 16) {
            u32 a0 = *(const u32*)(q0 + kd + 2 * tg), a1 = *(const u32*)(q1 + kd + 2 * tg);
            u32 a2 = *(const u32*)(q0 + kd + 8 + 2 * tg), a3 = *(const u32*)(q1 + kd + 8 + 2 * tg);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const u16* kr = kt + (nt * 8 + g) * TC_KS + kd;
                u32 b0 = *(const u32*)(kr + 2 * tg), b1 = *(const u32*)(kr + 8 + 2 * tg);
                mma_bf16_16816(s[nt], a0, a1, a2, a3, b0, b1);
            }
        }
        // Scale and mask: key index of s[nt][j] is nt·8 + 2·tg + (j & 1).
        float tm0 = CSA2_NEG_INF, tm1 = CSA2_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                int kk = nt * 8 + 2 * tg + (j & 1);
                bool valid = (k0 + kk) < n_keys && slot_s[kk] >= 0;
                s[nt][j] = valid ? s[nt][j] * scale : CSA2_NEG_INF;
                if (j < 2) tm0 = fmaxf(tm0, s[nt][j]);
                else tm1 = fmaxf(tm1, s[nt][j]);
            }
        // Row maxima over the 4 threads holding a row.
        tm0 = fmaxf(tm0, __shfl_xor_sync(CSA2_FULL_MASK, tm0, 1));
        tm0 = fmaxf(tm0, __shfl_xor_sync(CSA2_FULL_MASK, tm0, 2));
        tm1 = fmaxf(tm1, __shfl_xor_sync(CSA2_FULL_MASK, tm1, 1));
        tm1 = fmaxf(tm1, __shfl_xor_sync(CSA2_FULL_MASK, tm1, 2));
        float n0 = fmaxf(m0, tm0), n1 = fmaxf(m1, tm1);
        // A tile with no valid key leaves the state as it is (n = m; -inf rows stay -inf).
        float c0 = n0 == CSA2_NEG_INF ? 1.0f : expf(m0 - n0);
        float c1 = n1 == CSA2_NEG_INF ? 1.0f : expf(m1 - n1);
        float p[2][4];
        float r0 = 0.0f, r1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float nn = j < 2 ? n0 : n1;
                p[nt][j] = nn == CSA2_NEG_INF ? 0.0f : expf(s[nt][j] - nn);
                if (j < 2) r0 += p[nt][j];
                else r1 += p[nt][j];
            }
        r0 += __shfl_xor_sync(CSA2_FULL_MASK, r0, 1);
        r0 += __shfl_xor_sync(CSA2_FULL_MASK, r0, 2);
        r1 += __shfl_xor_sync(CSA2_FULL_MASK, r1, 1);
        r1 += __shfl_xor_sync(CSA2_FULL_MASK, r1, 2);
        l0 = l0 * c0 + r0;
        l1 = l1 * c1 + r1;
        m0 = n0;
        m1 = n1;
        // P as the A fragment of P·V (16 heads × 16 keys), bf16.
        u32 pa0 = pack_bf16x2(p[0][0], p[0][1]), pa1 = pack_bf16x2(p[0][2], p[0][3]);
        u32 pa2 = pack_bf16x2(p[1][0], p[1][1]), pa3 = pack_bf16x2(p[1][2], p[1][3]);
#pragma unroll
        for (int n = 0; n < TC_NT; ++n) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
            // B = V (16 keys × 8 dims), col-major: b0 = keys 2tg, 2tg+1 at dim g; b1 = keys + 8.
            int dim = d0 + n * 8 + g;
            const u16* v0 = kt + (2 * tg) * TC_KS + dim;
            u32 b0 = (u32)v0[0] | ((u32)v0[TC_KS] << 16);
            u32 b1 = (u32)v0[8 * TC_KS] | ((u32)v0[9 * TC_KS] << 16);
            mma_bf16_16816(o[n], pa0, pa1, pa2, pa3, b0, b1);
        }
    }

    // Sink in the denominator only; a row with nothing attended stays zero.
    int ha = h0 + g, hb = h0 + g + 8;
    float f0 = 0.0f, f1 = 0.0f;
    if (m0 != CSA2_NEG_INF) f0 = sink_factor(m0, l0, (sink && ha < n_heads) ? sink[ha] : CSA2_NEG_INF);
    if (m1 != CSA2_NEG_INF) f1 = sink_factor(m1, l1, (sink && hb < n_heads) ? sink[hb] : CSA2_NEG_INF);
    u16* oa = out + ((i64)t * hp + ha) * D + d0;
    u16* ob = out + ((i64)t * hp + hb) * D + d0;
    bool la = ha < n_heads, lb = hb < n_heads;
#pragma unroll
    for (int n = 0; n < TC_NT; ++n) {
        int c = n * 8 + 2 * tg;
        *(u32*)(oa + c) = la ? pack_bf16x2(o[n][0] * f0, o[n][1] * f0) : 0u;
        *(u32*)(ob + c) = lb ? pack_bf16x2(o[n][2] * f1, o[n][3] * f1) : 0u;
    }
    if (d0 == 0 && tg == 0 && lse) {
        if (la) lse[(i64)t * n_heads + ha] = m0 == CSA2_NEG_INF ? CSA2_NEG_INF : m0 + logf(l0);
        if (lb) lse[(i64)t * n_heads + hb] = m1 == CSA2_NEG_INF ? CSA2_NEG_INF : m1 + logf(l1);
    }
}

// ---- split-over-keys tensor-core kernel (the default GPU route) -----------------------------------
//
// attn_pools_bf16_split: same arguments and results as attn_pools_bf16 plus (chunk, splits, ws).
// Flash-decoding: the keys of token t — its compressed list then its SWA list, one sequence of
// n_keys = main_len + swa_len positions — are cut into chunks of `chunk` keys (a multiple of 16,
// chosen by the launch: src/ops/attention/cuda.rs::split_plan); block (x, t, s) handles chunk s
// of token t for the 64 padded heads 64·x .. 64·x + 63. A chunk boundary may fall anywhere: inside
// the compressed list, inside the SWA list or between them; a chunk past n_keys is empty.
// attn_pools_bf16_split_h32: the same with 32 heads per block (block x: heads 32·x .. 32·x + 31),
// each warp a quarter of the dims, so that it holds half the registers and two blocks share an SM.
//
// Per block and head the kernel keeps the online-softmax state (m, l, o) of its chunk in f32
// (o unnormalised: o = Σ e^{z − m} v). With splits == 1 it finishes the head itself; otherwise it
// writes (m, l, o) to the workspace and attn_pools_combine merges the chunks of each head.
//
// Merge rule (fixed, so the bits of a head never depend on timing, on which block ran first or on
// the other tokens of the batch): M = max over the chunks' m; L = Σ_s w_s·l_s and O = Σ_s w_s·o_s
// with w_s = e^{m_s − M}, summed in ascending chunk order starting from 0; out = O·f with
// f = sink_factor(M, L, sink) (the sink enters once, here); lse = M + log L. A single chunk gives
// w = 1, L = l, O = o exactly, which is what the splits == 1 path computes directly. The bits of
// a token therefore depend on its own inputs and on `chunk` only: two batches planned with the same
// chunk give every shared token the same bits, whatever the batch size or the split count. The
// default plan (split_plan.rs) picks the chunk from the batch size to fill the SMs, so across batch
// sizes a token keeps its bits only under a pinned chunk.
//
// Workspace (splits > 1): f32 [T][splits][hp][D] partial outputs, then f32 [T][splits][hp][2]
// (m, l); empty chunks write only (−inf, 0). One buffer per device, reserved when the modules are
// preloaded with room for every default plan, at a fixed address (a captured graph replays
// against it).
//
// Warp layout (split_body<HT>, HT head tiles of 16 per block, DP = 8 / HT dim parts): warp w owns
// heads 16·(w % HT) .. +16 and the output dims (512 / DP)·(w / HT) .. + 512 / DP. With HT = 4 (64
// heads) that is attn_pools_bf16_mma's layout, dim halves of 256; with HT = 2 (32 heads) quarters
// of 128. Unlike the mma kernel:
//   - Q's A fragments for the warp's own dims are loaded once per block and stay in registers
//     (64 per lane for halves beside 128 output accumulators; for quarters, beside 64, the first
//     half of them, 16 per lane, the rest read again each tile: see QREG below); each
//     warp computes S = Q·Kᵀ over its own dims only, and the DP warps of a head tile add their
//     parts through shared memory in a fixed order (part 0 + part 1 + …, left to right), so all
//     hold the same S bits. The two variants therefore round S differently: a head's bits depend
//     on the variant (and on the chunk), never on the batch.
//   - Records are streamed: the raw bytes of tile i + 2 are copied into shared memory with 16-byte
//     cp.async while tile i computes (two raw buffers; a record whose address is not 16-byte aligned,
//     e.g. a V4 record's 8 scale bytes, is copied with plain loads instead), then dequantised from
//     shared memory with 16-byte loads into the bf16 key tile.
//   - The bf16 key tile is written with 16-byte stores in a rotated order (see sk_store_row) and read
//     by the fragments with the padded row stride, both without bank conflicts.

#define SK_KT 16
#define SK_REC 592         // raw bytes per key in shared memory: the largest record (584) rounded up to 16
#define SK_KS (D + 8)      // bf16 row stride of the dequantised tile
#if CSA2_NVFP4_DATA + CSA2_NVFP4_SCALE > SK_REC || CSA2_MXFP8_DATA + CSA2_MXFP8_SCALE > SK_REC || \
    CSA2_V4_DATA + CSA2_V4_SCALE > SK_REC || CSA2_NVFP4_DATA % 16 || CSA2_MXFP8_DATA % 16 || CSA2_V4_DATA % 16
#error "attn_pools_bf16_split: every record must fit one raw slot, its scales starting 16-byte aligned"
#endif
#if D != 512 || CSA2_NOPE_DIM % 64 != 0
#error "attn_pools_bf16_split: its dequantising split is 16 threads × 32 dims of a 512-dim key"
#endif

// 16 bytes, the unit of the kernel's vector loads and stores (as CUDA's uint4).
struct __align__(16) u32x4 {
    u32 w[4];
};

// Asynchronous global → shared copies (sm_80+). The host SIMT harness queues them per thread and
// performs them at the wait, poisoning the destination at issue, so a read before the wait shows.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#ifdef CSA2_SIMT_HOST
    csa2_simt::cp_async(smem, gmem, 16);
#else
    u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef CSA2_SIMT_HOST
    csa2_simt::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef CSA2_SIMT_HOST
    csa2_simt::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// n bytes from global `src` to shared `dst` (16-byte aligned), shared by the 16 threads part = 0..15
// of a key: 16-byte cp.async when src is 16-byte aligned (the tail, if any, with plain loads),
// byte loads otherwise.
__device__ __forceinline__ void sk_copy(u8* dst, const u8* src, int n, int part) {
    if (((u64)src & 15) == 0) {
        int v = n >> 4;
        for (int c = part; c < v; c += 16) cp_async16(dst + 16 * c, src + 16 * c);
        for (int b = 16 * v + part; b < n; b += 16) dst[b] = src[b];
    } else {
        for (int b = part; b < n; b += 16) dst[b] = src[b];
    }
}

struct SplitSmem {
    u8 raw[2][SK_KT][SK_REC];   // raw records of two tiles in flight
    u16 kt[SK_KT * SK_KS];      // the dequantised bf16 key tile
    float sx[8][8][32];         // S parts: [warp][fragment value][lane]
    i64 slot[2][SK_KT];
    int kind[2][SK_KT];
};

// Slots of keys kbase .. kbase + 15 (positions in the token's key sequence; none at or past kend)
// into buffer `buf`, and their records' copies issued (one cp.async group per thread, committed
// even when empty so the wait counts stay aligned). Thread (kk = tid / 16, part = tid % 16).
__device__ __forceinline__ void sk_issue(SplitSmem& sm, int buf, int t, int kbase, int kend, const PoolsRow& pr,
                                         const i32* main_idx, int km, const i32* swa_idx, int ks, i32* err) {
    int tid = threadIdx.x, lane = tid & 31, kk = tid >> 4, part = tid & 15;
    int k = kbase + kk;
    i64 slot = -1;
    int kind = 0;
    if (part == 0 && k < kend) pools_key_slot(t, k, pr, main_idx, km, swa_idx, ks, err, &slot, &kind);
    slot = __shfl_sync(CSA2_FULL_MASK, slot, lane & 16);
    kind = __shfl_sync(CSA2_FULL_MASK, kind, lane & 16);
    if (part == 0) {
        sm.slot[buf][kk] = slot;
        sm.kind[buf][kk] = kind;
    }
    if (slot >= 0) {
        const Pool& p = kind == 1 ? pr.mp : pr.sp;
        int db = fmt_data_bytes(p.fmt), sb = fmt_scale_bytes(p.fmt);
        SlotPtr sp = pool_slot_ptr((u8*)p.base, p.stride, slot, p.states, db, sb, p.layout);
        sk_copy(sm.raw[buf][kk], sp.data, db, part);
        sk_copy(sm.raw[buf][kk] + db, sp.scale, sb, part);
    }
    cp_async_commit();
}

// Byte i (0..15) of a 16-byte vector.
__device__ __forceinline__ u32 sk_byte(const u32x4& v, int i) { return (v.w[i >> 2] >> (8 * (i & 3))) & 0xffu; }

// Dims [32c, 32c + 32) of the raw record `r` (format fmt) as 16 bf16 pairs (lower dim in the low
// half). Reads 16-byte vectors from shared memory, served per quarter warp (8 threads c0 .. c0 + 7
// of one key, 128 bytes per pass): NVFP4 threads read 8 consecutive vectors, conflict-free. MXFP8
// and V4 NoPE threads read two vectors 32 bytes apart; in plain order thread c's first vector sits
// in 16-byte bank group 2c mod 8, so c and c + 4 collide (2-way). Thread c therefore reads its half
// x = (c / 4) mod 2 first: group (2c + x) mod 8 is {0, 2, 4, 6} for c0 .. c0 + 3 and {1, 3, 5, 7}
// for the next four — conflict-free — and the halves are put back in order with selects.
__device__ __forceinline__ void sk_dequant_row(const u8* r, int fmt, int c, u32* o) {
    if (fmt == CSA2_FMT_NVFP4) {
        u32x4 d = *(const u32x4*)(r + 16 * c);
        float s0 = e4m3_decode(r[CSA2_NVFP4_DATA + 2 * c]), s1 = e4m3_decode(r[CSA2_NVFP4_DATA + 2 * c + 1]);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            u32 b = sk_byte(d, i);
            float s = i < 8 ? s0 : s1;
            o[i] = pack_bf16x2(e2m1_decode(b & 0xf) * s, e2m1_decode(b >> 4) * s);
        }
    } else if (fmt == CSA2_FMT_MXFP8 || c < CSA2_NOPE_DIM / 32) {
        float s = e8m0_decode(fmt == CSA2_FMT_MXFP8 ? r[CSA2_MXFP8_DATA + c] : r[CSA2_V4_DATA + c / 2]);
        int x = (c >> 2) & 1;
        u32x4 first = *(const u32x4*)(r + 32 * c + 16 * x);
        u32x4 second = *(const u32x4*)(r + 32 * c + 16 * (x ^ 1));
        u32x4 half[2];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            half[0].w[e] = x ? second.w[e] : first.w[e];
            half[1].w[e] = x ? first.w[e] : second.w[e];
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 8; ++i)
                o[8 * h + i] =
                    pack_bf16x2(e4m3_decode(sk_byte(half[h], 2 * i)) * s, e4m3_decode(sk_byte(half[h], 2 * i + 1)) * s);
    } else {
        // V4 RoPE dims: already bf16 (little-endian pairs), copied as they are.
        const u8* b = r + CSA2_NOPE_DIM + 64 * (c - CSA2_NOPE_DIM / 32);
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            u32x4 d = *(const u32x4*)(b + 16 * h);
#pragma unroll
            for (int i = 0; i < 4; ++i) o[4 * h + i] = d.w[i];
        }
    }
}

// Stores the 64 bytes of dims [32c, 32c + 32) of one key row as four 16-byte vectors. Bank
// arithmetic: a 16-byte store is served per quarter warp (8 threads, 128 bytes per pass). The 8
// threads c = c0 .. c0 + 7 of one key write at byte 64c + 16j of the row in pass j; with the plain
// order j, the 16-byte bank group (4 banks) of thread c is (4c + j) mod 8, so c and c + 2 collide:
// 4-way conflicts. Rotating the vector order to j' = (j + c / 2) mod 4 gives group
// 4·(c mod 2) + (j + c / 2) mod 4: the even threads take the four groups 0..3 in some order and the
// odd threads 4..7, all eight distinct — conflict-free. (The row stride, 1040 bytes, is a multiple
// of 16, so each row starts at a bank group boundary; the pad exists for the fragment reads.)
__device__ __forceinline__ void sk_store_row(u16* row, int c, const u32* v) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        int jj = (j + (c >> 1)) & 3;
        u32x4 w;
        // Selects, not v[4·jj + e]: a register array indexed at run time would live in local memory.
#pragma unroll
        for (int e = 0; e < 4; ++e) w.w[e] = jj == 0 ? v[e] : jj == 1 ? v[4 + e] : jj == 2 ? v[8 + e] : v[12 + e];
        *(u32x4*)(row + 32 * c + 8 * jj) = w;
    }
}

// One head's finished output factor and lse from its merged (M, L): the sink enters here, once.
// Shared by the splits == 1 path of the split kernel and by attn_pools_combine (same bits).
__device__ __forceinline__ float sk_factor(float M, float L, float sk) {
    return M == CSA2_NEG_INF ? 0.0f : sink_factor(M, L, sk);
}
__device__ __forceinline__ float sk_lse(float M, float L) { return M == CSA2_NEG_INF ? CSA2_NEG_INF : M + logf(L); }

#define ATTN_SPLIT_ARGS ATTN_POOLS_ARGS, int chunk, int splits, float *__restrict__ ws
#define ATTN_SPLIT_PARAMS                                                                                 \
    q, hp, n_heads, main_idx, km, main_len, main_pool, main_stride, main_states, main_blocks, main_fmt,  \
        main_layout, swa_idx, ks, swa_len, swa_pool, swa_stride, swa_states, swa_blocks, swa_fmt,        \
        swa_layout, sink, scale, out, lse, err, chunk, splits, ws

template <int HT>
__device__ __forceinline__ void split_body(SplitSmem& sm, ATTN_SPLIT_ARGS) {
    constexpr int DP = 8 / HT;       // dim parts: the warps that share a head tile
    constexpr int DW = D / DP;       // dims per warp
    constexpr int NT = DW / 8;       // P·V n-tiles (8 dims) per warp
    constexpr int KSTEP = DW / 16;   // Q·Kᵀ k-steps (16 dims) per warp
    constexpr int HT_LOG = HT == 4 ? 2 : 1;
    static_assert(HT == 2 || HT == 4, "split_body: 2 or 4 head tiles per block");
    int t = blockIdx.y, sidx = blockIdx.z, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, tg = lane & 3, dpart = warp >> HT_LOG;
    int h0 = blockIdx.x * (16 * HT) + (warp & (HT - 1)) * 16;
    int d0 = dpart * DW;
    PoolsRow pr = POOLS_ROW(t);
    int kbeg = sidx * chunk, kend = kbeg + chunk;
    if (kend > pr.n_keys) kend = pr.n_keys;
    int n_tiles = kend > kbeg ? (kend - kbeg + SK_KT - 1) / SK_KT : 0;

    // Prefetch the first two tiles before touching Q.
    sk_issue(sm, 0, t, kbeg, kend, pr, main_idx, km, swa_idx, ks, err);
    sk_issue(sm, 1, t, kbeg + SK_KT, kend, pr, main_idx, km, swa_idx, ks, err);

    // Q's A fragments for this warp's 16 heads and DW dims, once (heads past hp do not exist).
    // With quarters (HT = 2) only the first half of the k-steps' fragments stay in registers
    // (16 per lane): all of them with the 64 output accumulators pass the 128 registers two
    // blocks per SM allow (ptxas spilled 32-60 bytes); the other half is read again each tile from
    // global memory (L1: the block's q is 32 KB).
    constexpr int QREG = HT == 4 ? KSTEP : KSTEP / 2;
    const u16* qrow0 = q + ((i64)t * hp + h0 + g) * D + d0 + 2 * tg;
    u32 qa[QREG][4];
    {
        const u16* q0 = qrow0;
        const u16* q1 = q0 + 8 * D;
#pragma unroll
        for (int j = 0; j < QREG; ++j) {
            qa[j][0] = *(const u32*)(q0 + 16 * j);
            qa[j][1] = *(const u32*)(q1 + 16 * j);
            qa[j][2] = *(const u32*)(q0 + 16 * j + 8);
            qa[j][3] = *(const u32*)(q1 + 16 * j + 8);
        }
    }
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = CSA2_NEG_INF, m1 = CSA2_NEG_INF, l0 = 0.0f, l1 = 0.0f;

    for (int it = 0; it < n_tiles; ++it) {
        int buf = it & 1, k0 = kbeg + it * SK_KT;
        cp_async_wait<1>();  // this thread's copies of tile `it` have landed (tile it + 1 may not)
        __syncthreads();     // everyone's have; the key tile and the S halves of tile it − 1 are free
        // Which of this thread's four score columns (keys nt·8 + 2·tg + e) are real keys: read now,
        // before the issue below reuses the slot buffer for tile it + 2.
        bool valid[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int kk = nt * 8 + 2 * tg + e;
                valid[nt][e] = (k0 + kk) < kend && sm.slot[buf][kk] >= 0;
            }
        {
            int kk = tid >> 4, c = tid & 15;
            i64 slot = sm.slot[buf][kk];
            u32 v[16];
            if (slot < 0) {
#pragma unroll
                for (int i = 0; i < 16; ++i) v[i] = 0u;
            } else {
                sk_dequant_row(sm.raw[buf][kk], sm.kind[buf][kk] == 1 ? main_fmt : swa_fmt, c, v);
            }
            sk_store_row(sm.kt + kk * SK_KS, c, v);
        }
        __syncthreads();  // key tile written; raw buffer `buf` is free again
        sk_issue(sm, buf, t, k0 + 2 * SK_KT, kend, pr, main_idx, km, swa_idx, ks, err);

        // This warp's part of S = Q Kᵀ: 16 heads × 16 keys over dims d0 .. d0 + DW − 1.
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int j = 0; j < KSTEP; ++j) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const u16* kr = sm.kt + (nt * 8 + g) * SK_KS + d0 + 16 * j;
                u32 b0 = *(const u32*)(kr + 2 * tg), b1 = *(const u32*)(kr + 8 + 2 * tg);
                if (j < QREG) {
                    mma_bf16_16816(s[nt], qa[j][0], qa[j][1], qa[j][2], qa[j][3], b0, b1);
                } else {
                    const u16* q0 = qrow0 + 16 * j;
                    const u16* q1 = q0 + 8 * D;
                    mma_bf16_16816(s[nt], *(const u32*)q0, *(const u32*)q1, *(const u32*)(q0 + 8),
                                   *(const u32*)(q1 + 8), b0, b1);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) sm.sx[warp][i][lane] = s[i >> 2][i & 3];
        __syncthreads();  // both halves of S written
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            // The part-0 warp of this head tile, then parts 1 .. DP − 1 in order.
            int w0 = warp & (HT - 1);
            float acc = sm.sx[w0][i][lane];
#pragma unroll
            for (int pp = 1; pp < DP; ++pp) acc += sm.sx[w0 + pp * HT][i][lane];
            s[i >> 2][i & 3] = acc;
        }
        // Scale and mask: the key of s[nt][j] is nt·8 + 2·tg + (j & 1).
        float tm0 = CSA2_NEG_INF, tm1 = CSA2_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                s[nt][j] = valid[nt][j & 1] ? s[nt][j] * scale : CSA2_NEG_INF;
                if (j < 2) tm0 = fmaxf(tm0, s[nt][j]);
                else tm1 = fmaxf(tm1, s[nt][j]);
            }
        tm0 = fmaxf(tm0, __shfl_xor_sync(CSA2_FULL_MASK, tm0, 1));
        tm0 = fmaxf(tm0, __shfl_xor_sync(CSA2_FULL_MASK, tm0, 2));
        tm1 = fmaxf(tm1, __shfl_xor_sync(CSA2_FULL_MASK, tm1, 1));
        tm1 = fmaxf(tm1, __shfl_xor_sync(CSA2_FULL_MASK, tm1, 2));
        float n0 = fmaxf(m0, tm0), n1 = fmaxf(m1, tm1);
        float c0 = n0 == CSA2_NEG_INF ? 1.0f : expf(m0 - n0);
        float c1 = n1 == CSA2_NEG_INF ? 1.0f : expf(m1 - n1);
        float p[2][4];
        float r0 = 0.0f, r1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float nn = j < 2 ? n0 : n1;
                p[nt][j] = nn == CSA2_NEG_INF ? 0.0f : expf(s[nt][j] - nn);
                if (j < 2) r0 += p[nt][j];
                else r1 += p[nt][j];
            }
        r0 += __shfl_xor_sync(CSA2_FULL_MASK, r0, 1);
        r0 += __shfl_xor_sync(CSA2_FULL_MASK, r0, 2);
        r1 += __shfl_xor_sync(CSA2_FULL_MASK, r1, 1);
        r1 += __shfl_xor_sync(CSA2_FULL_MASK, r1, 2);
        l0 = l0 * c0 + r0;
        l1 = l1 * c1 + r1;
        m0 = n0;
        m1 = n1;
        u32 pa0 = pack_bf16x2(p[0][0], p[0][1]), pa1 = pack_bf16x2(p[0][2], p[0][3]);
        u32 pa2 = pack_bf16x2(p[1][0], p[1][1]), pa3 = pack_bf16x2(p[1][2], p[1][3]);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
            // B = V (16 keys × 8 dims), col-major: b0 = keys 2tg, 2tg + 1 at dim g; b1 = keys + 8.
            // Word banks: (260·2tg + dim / 2) mod 32 = 8tg + g / 2 + const: 16 words, two lanes each.
            const u16* v0 = sm.kt + (2 * tg) * SK_KS + d0 + n * 8 + g;
            u32 b0 = (u32)v0[0] | ((u32)v0[SK_KS] << 16);
            u32 b1 = (u32)v0[8 * SK_KS] | ((u32)v0[9 * SK_KS] << 16);
            mma_bf16_16816(o[n], pa0, pa1, pa2, pa3, b0, b1);
        }
    }
    cp_async_wait<0>();  // no copy outlives the block

    int ha = h0 + g, hb = h0 + g + 8;
    bool la = ha < n_heads, lb = hb < n_heads;
    if (splits == 1) {
        float f0 = sk_factor(m0, l0, (sink && la) ? sink[ha] : CSA2_NEG_INF);
        float f1 = sk_factor(m1, l1, (sink && lb) ? sink[hb] : CSA2_NEG_INF);
        u16* oa = out + ((i64)t * hp + ha) * D + d0;
        u16* ob = out + ((i64)t * hp + hb) * D + d0;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            int c = n * 8 + 2 * tg;
            *(u32*)(oa + c) = la ? pack_bf16x2(o[n][0] * f0, o[n][1] * f0) : 0u;
            *(u32*)(ob + c) = lb ? pack_bf16x2(o[n][2] * f1, o[n][3] * f1) : 0u;
        }
        if (dpart == 0 && tg == 0 && lse) {
            if (la) lse[(i64)t * n_heads + ha] = sk_lse(m0, l0);
            if (lb) lse[(i64)t * n_heads + hb] = sk_lse(m1, l1);
        }
        return;
    }
    // Partial (m, l, o) of this chunk for the combine; an empty chunk writes only (−inf, 0).
    i64 part = (i64)t * splits + sidx;
    float* ml = ws + (i64)gridDim.y * splits * hp * D + part * hp * 2;
    if (dpart == 0 && tg == 0) {
        ml[2 * ha] = m0;
        ml[2 * ha + 1] = l0;
        ml[2 * hb] = m1;
        ml[2 * hb + 1] = l1;
    }
    if (m0 != CSA2_NEG_INF || m1 != CSA2_NEG_INF) {
        float* pa = ws + (part * hp + ha) * D + d0;
        float* pb = ws + (part * hp + hb) * D + d0;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            int c = n * 8 + 2 * tg;
            pa[c] = o[n][0];
            pa[c + 1] = o[n][1];
            pb[c] = o[n][2];
            pb[c + 1] = o[n][3];
        }
    }
}

// The entry points: each declares the block's shared memory (a __shared__ inside the template would
// not be placed with the other shared variables on the host SIMT harness, so it would escape the
// poisoning before each block) and runs the body with its head tiles.
extern "C" __global__ void __launch_bounds__(CSA2_ATTN_THREADS, 1) attn_pools_bf16_split(ATTN_SPLIT_ARGS) {
    __shared__ __align__(16) SplitSmem sm;
    split_body<4>(sm, ATTN_SPLIT_PARAMS);
}

extern "C" __global__ void __launch_bounds__(CSA2_ATTN_THREADS, 2) attn_pools_bf16_split_h32(ATTN_SPLIT_ARGS) {
    __shared__ __align__(16) SplitSmem sm;
    split_body<2>(sm, ATTN_SPLIT_PARAMS);
}

// Merges the `splits` partials of attn_pools_bf16_split per (token, head) by the rule above.
// Grid = (hp / 8, T), block = 256: warp w takes head 8·x + w, lane i the dims 4i + 128j (j < 4) as
// 16-byte vectors. Padded heads are written as zeros; lse only for live heads.
extern "C" __global__ void __launch_bounds__(CSA2_ATTN_THREADS) attn_pools_combine(
    const float* __restrict__ ws, int splits, int hp, int n_heads, const float* __restrict__ sink,
    u16* __restrict__ out, float* __restrict__ lse) {
    int t = blockIdx.y, lane = threadIdx.x & 31, h = blockIdx.x * (CSA2_ATTN_THREADS / 32) + (threadIdx.x >> 5);
    u16* oh = out + ((i64)t * hp + h) * D;
    if (h >= n_heads) {
#pragma unroll
        for (int j = 0; j < 4; ++j) *(u32*)(oh + 4 * lane + 128 * j) = *(u32*)(oh + 4 * lane + 128 * j + 2) = 0u;
        return;
    }
    const float* ml = ws + (i64)gridDim.y * splits * hp * D + ((i64)t * splits * hp + h) * 2;
    float M = CSA2_NEG_INF;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, ml[(i64)s * hp * 2]);
    float L = 0.0f;
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int s = 0; s < splits && M != CSA2_NEG_INF; ++s) {
        float m_s = ml[(i64)s * hp * 2];
        if (m_s == CSA2_NEG_INF) continue;  // an empty chunk: no output was written
        float w = expf(m_s - M);
        L += w * ml[(i64)s * hp * 2 + 1];
        const float* po = ws + (((i64)t * splits + s) * hp + h) * D + 4 * lane;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float4 v = *(const float4*)(po + 128 * j);
            acc[j][0] += w * v.x;
            acc[j][1] += w * v.y;
            acc[j][2] += w * v.z;
            acc[j][3] += w * v.w;
        }
    }
    float f = sk_factor(M, L, sink ? sink[h] : CSA2_NEG_INF);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        *(u32*)(oh + 4 * lane + 128 * j) = pack_bf16x2(acc[j][0] * f, acc[j][1] * f);
        *(u32*)(oh + 4 * lane + 128 * j + 2) = pack_bf16x2(acc[j][2] * f, acc[j][3] * f);
    }
    if (lane == 0 && lse) lse[(i64)t * n_heads + h] = sk_lse(M, L);
}
