// Lightning-indexer logits over paged MXFP4 index K, and the hierarchical candidate pool (docs/SPEC.md §2).
//
//   logit[t, j] = Σ_h w[t, h] · ReLU(q[t, h] · k_j)     for visible j < (pos[t] + 1) div ratio
// Invisible entries (and, when a candidate mask is given, entries outside the pool) get -Inf.
// Decode is the case of one query per request; prefill passes every prompt row with its own
// position (causal visibility). ReLU keeps NaN (no silent NaN: a NaN K row yields a NaN logit).
#include "common.cuh"

#define HEADS CSA2_INDEX_HEADS
#define DIM CSA2_INDEX_DIM
#define ENTRIES_PER_BLOCK CSA2_INDEXER_ENTRIES_PER_BLOCK
#define WARPS (CSA2_INDEXER_THREADS / 32)
#define CB CSA2_CANDIDATE_BLOCK_SIZE
// Lane h holds head h; lane l decodes index-K dims [4l, 4l + 4) with the E8M0 scale of its 32.
#if HEADS != 32 || DIM != 4 * 32
#error "indexer_logits_f32: one lane per head (32 heads) and 4 index-K dims per lane"
#endif

// q: (T, HEADS, DIM) f32; w: (T, HEADS) f32; pos, req: (T,) i32; block_table: (R, max_blocks) i32;
// cand_mask: (T, mask_stride) u8 per block of CB entries, 1 = in the pool, or null;
// logits: (T, n_cols) f32. Launch: grid = (ceil(n_cols / ENTRIES_PER_BLOCK), T), block = WARPS · 32.
extern "C" __global__ void indexer_logits_f32(
    const float* __restrict__ q, const float* __restrict__ w, const i32* __restrict__ pos,
    const i32* __restrict__ req, const i32* __restrict__ block_table, int max_blocks, int page_slots,
    const u8* __restrict__ index_pages, int ratio, const u8* __restrict__ cand_mask, int mask_stride,
    float* __restrict__ logits, int n_cols) {
    __shared__ float4 ks[WARPS][DIM / 4];
    int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Lane h keeps head h's query (DIM floats) and weight in registers.
    float qh[DIM];
    const float4* q4 = (const float4*)(q + ((i64)t * HEADS + lane) * DIM);
#pragma unroll
    for (int i = 0; i < DIM / 4; ++i) {
        float4 v = q4[i];
        qh[4 * i] = v.x;
        qh[4 * i + 1] = v.y;
        qh[4 * i + 2] = v.z;
        qh[4 * i + 3] = v.w;
    }
    float wh = w[(i64)t * HEADS + lane];
    i64 visible = ((i64)pos[t] + 1) / ratio;
    const i32* bt = block_table + (i64)req[t] * max_blocks;
    float* out = logits + (i64)t * n_cols;

    for (int e = warp; e < ENTRIES_PER_BLOCK; e += WARPS) {
        i64 j = (i64)blockIdx.x * ENTRIES_PER_BLOCK + e;
        if (j >= n_cols) break;
        bool ok = j < visible;
        if (ok && cand_mask) ok = cand_mask[(i64)t * mask_stride + j / CB] != 0;
        i64 slot = ok ? table_slot(bt, max_blocks, j, page_slots) : -1;
        if (slot < 0) {
            if (lane == 0) out[j] = CSA2_NEG_INF;
            continue;
        }
        // Lane l decodes dims [4l, 4l + 4) (two packed bytes) with its block's E8M0 scale.
        SlotPtr p = slot_ptr((u8*)index_pages, slot, page_slots, CSA2_MXFP4_INDEX_DATA, CSA2_MXFP4_INDEX_SCALE);
        u32 b = *(const u16*)(p.data + 2 * lane);
        float s = e8m0_decode(p.scale[lane / 8]);
        ks[warp][lane] = make_float4(e2m1_decode(b & 0xf) * s, e2m1_decode((b >> 4) & 0xf) * s,
                                     e2m1_decode((b >> 8) & 0xf) * s, e2m1_decode((b >> 12) & 0xf) * s);
        __syncwarp();
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < DIM / 4; ++i) {
            float4 k = ks[warp][i];
            dot += qh[4 * i] * k.x + qh[4 * i + 1] * k.y + qh[4 * i + 2] * k.z + qh[4 * i + 3] * k.w;
        }
        float v = (dot < 0.0f ? 0.0f : dot) * wh;
        v = warp_sum(v);
        if (lane == 0) out[j] = v;
        __syncwarp();
    }
}

// ---- the pooled indexer over vLLM's strided index-K slab (src/ops/indexer/mod.rs
// `logits_in_pool`, the CPU entry this kernel mirrors) -------------------------------------------
//
// Row t (request req[t], position pos[t]) scores entries j < n_cols of its request: entry j lives
// at slot block_table[req[t], j / states] · states + j % states of a block-planar MXFP4 index-K
// pool whose pages are `block_stride` bytes apart (vLLM's per-block slab, read from the tensor's
// stride(0)). logit = Σ_{h < heads} w[t,h] · max(q[t,h] · k_j, 0) for visible (j < (pos + 1) div
// ratio), mapped entries; -Inf elsewhere. ReLU is fmaxf(x, 0): NaN → 0, as the CPU entry's
// `f32::max`. The query is fake-quantised first (none, MXFP4, FP8 with one power-of-two scale per
// row, or bf16; the rules of src/formats/records.rs): the mode is a template parameter with one
// entry point each (`indexer_logits_pool_f32_qnone`, `_qmxfp4`, `_qfp8`, `_qbf16`, the
// QueryQuant the launch code names), so each entry point holds only its own quantiser's code.
// q, w and logits are f32, bf16 or f16, each named by its CSA2_DTYPE_* code (the host entry's
// dtypes; loads are exact, the logits are rounded to nearest even on the store, as the host
// entry's conversion).
//
// Nothing is checked on the host (that would need the values): a negative position, a request
// outside 0..n_req or a block id outside -1..blocks is recorded once in err[4] = {kind (1 request,
// 2 block, 3 position), row, column, value} (first writer wins; the caller zeroes err and reads it
// whenever it syncs), and the affected entries are written as -Inf. Raw pointers only, no host
// access, no allocation: capturable in a CUDA graph.
//
// Launch: grid = (ceil(n_cols / ENTRIES_PER_BLOCK), min(rows, 65535)), block = WARPS · 32; grid
// rows stride over the query rows.

// The query modes (QueryQuant, src/ops/indexer/mod.rs).
#define QQ_NONE 0
#define QQ_MXFP4 1
#define QQ_FP8 2
#define QQ_BF16 3

// In-lane fake quantisation of one head row (DIM values in registers), bit-exact to
// QueryQuant::apply (src/ops/indexer/mod.rs).
template <int QQ>
__device__ __forceinline__ void fake_quant_row(float* v) {
    if constexpr (QQ == QQ_BF16) {
#pragma unroll
        for (int i = 0; i < DIM; ++i) v[i] = bf16_round(v[i]);
    } else if constexpr (QQ == QQ_MXFP4) {
        // DeepSeek MXFP4 per 32: e = clamp(ceil(log2(max(amax, 6·2^-126) / 6)), -127, 127).
#pragma unroll
        for (int b = 0; b < DIM / 32; ++b) {
            float a = 0.0f;
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                v[32 * b + i] = bf16_round(v[32 * b + i]);
                a = fmaxf(a, fabsf(v[32 * b + i]));
            }
            a = fmaxf(a, 6.0f * csa2_pow2(-126));
            int e = ceil_log2(__fdiv_rn(a, 6.0f));
            e = e < -127 ? -127 : (e > 127 ? 127 : e);
            float inv = csa2_pow2(-e), s = csa2_pow2(e);
#pragma unroll
            for (int i = 0; i < 32; ++i) v[32 * b + i] = e2m1_decode(e2m1_encode_sw(v[32 * b + i] * inv)) * s;
        }
    } else if constexpr (QQ == QQ_FP8) {
        // E4M3 with one scale 2^e per row: amax floored at 1e-4, e = clamp(ceil(log2(amax/448)), -126, 127).
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < DIM; ++i) {
            v[i] = bf16_round(v[i]);
            a = fmaxf(a, fabsf(v[i]));
        }
        a = fmaxf(a, 1e-4f);
        int e = ceil_log2(__fdiv_rn(a, 448.0f));
        e = e < -126 ? -126 : (e > 127 ? 127 : e);
        float inv = csa2_pow2(-e), s = csa2_pow2(e);
#pragma unroll
        for (int i = 0; i < DIM; ++i) v[i] = e4m3_decode(e4m3_encode(clamp_keep_nan(v[i] * inv, -448.0f, 448.0f))) * s;
    }
}

// Records the first bad value of a call (see above).
__device__ __forceinline__ void pool_flag(i32* err, int kind, int row, i64 col, i64 value) {
    if (err && atomicCAS(&err[0], 0, kind) == 0) {
        err[1] = row;
        err[2] = (i32)col;
        err[3] = (i32)value;
    }
}

// q: (rows, heads, DIM) f32; w: (rows, heads) f32; pos: (rows,) i32 or i64 (pos_i64); req: (rows,)
// i32; block_table: (n_req, max_blocks) i32, -1 = unmapped; pool: block-planar 68-B MXFP4 index K
// (`blocks` pages of `states` records, `block_stride` bytes apart); logits: (rows, n_cols) f32;
// ks: the block's shared key rows (one per warp).
// The pooled indexer's parameters, shared by the body and its four entry points.
#define INDEXER_POOL_PARAMS                                                                            \
    const void *__restrict__ q, int q_dtype, const void *__restrict__ w, int w_dtype,                 \
        const void *__restrict__ pos, int pos_i64, const i32 *__restrict__ req, int n_req,            \
        const i32 *__restrict__ block_table, int max_blocks, const u8 *__restrict__ pool,             \
        i64 block_stride, int states, i64 blocks, int ratio, int heads, void *__restrict__ logits,    \
        int logits_dtype, int n_cols, int rows, i32 *__restrict__ err

template <int QQ>
__device__ __forceinline__ void indexer_logits_pool(INDEXER_POOL_PARAMS, float4 (*ks)[DIM / 4]) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    bool live = lane < heads;
    for (int t = blockIdx.y; t < rows; t += gridDim.y) {
        // Lane h keeps head h's (fake-quantised) query and weight in registers; lanes past the
        // heads add exact zeros. Every lane quantises (a zero row stays zero in every mode, and
        // those lanes' sums are dropped below): under a `live` branch the quantiser cost the bf16
        // entry point 255 registers and a spill on sm_86/sm_89.
        float qh[DIM];
        i64 q0 = ((i64)t * heads + (live ? lane : 0)) * DIM;
#pragma unroll
        for (int i = 0; i < DIM; ++i) qh[i] = live ? load_float(q, q_dtype, q0 + i) : 0.0f;
        fake_quant_row<QQ>(qh);
        float wh = live ? load_float(w, w_dtype, (i64)t * heads + lane) : 0.0f;
        i64 p = pos_i64 ? ((const i64*)pos)[t] : (i64)((const i32*)pos)[t];
        i32 r = req[t];
        bool row_ok = true;
        if (p < 0) {
            if (blockIdx.x == 0 && threadIdx.x == 0) pool_flag(err, 3, t, 0, p);
            row_ok = false;
        } else if (r < 0 || r >= n_req) {
            if (blockIdx.x == 0 && threadIdx.x == 0) pool_flag(err, 1, t, 0, r);
            row_ok = false;
        }
        // (p + 1) div ratio without overflowing at i64::MAX.
        i64 visible = row_ok ? p / ratio + (p % ratio + 1) / ratio : 0;
        const i32* bt = block_table + (i64)(row_ok ? r : 0) * max_blocks;
        i64 out0 = (i64)t * n_cols;
        for (int e = warp; e < ENTRIES_PER_BLOCK; e += WARPS) {
            i64 j = (i64)blockIdx.x * ENTRIES_PER_BLOCK + e;
            if (j >= n_cols) break;
            i64 slot = -1;
            if (j < visible && j / states < max_blocks) {
                i32 blk = bt[j / states];
                if (blk >= 0 && blk < blocks) {
                    slot = (i64)blk * states + j % states;
                } else if (blk != -1) {
                    if (lane == 0) pool_flag(err, 2, t, j, blk);
                }
            }
            if (slot < 0) {
                if (lane == 0) store_float(logits, logits_dtype, out0 + j, CSA2_NEG_INF);
                continue;
            }
            // Lane l decodes dims [4l, 4l + 4) (two packed bytes, read one by one: a slab offset
            // need not be even) with its block's E8M0 scale.
            SlotPtr sp = pool_slot_ptr((u8*)pool, block_stride, slot, states, CSA2_MXFP4_INDEX_DATA,
                                       CSA2_MXFP4_INDEX_SCALE, CSA2_POOL_BLOCK_PLANAR);
            u32 b = (u32)sp.data[2 * lane] | ((u32)sp.data[2 * lane + 1] << 8);
            float s = e8m0_decode(sp.scale[lane / 8]);
            ks[warp][lane] = make_float4(e2m1_decode(b & 0xf) * s, e2m1_decode((b >> 4) & 0xf) * s,
                                         e2m1_decode((b >> 8) & 0xf) * s, e2m1_decode((b >> 12) & 0xf) * s);
            __syncwarp();
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < DIM / 4; ++i) {
                float4 k = ks[warp][i];
                dot = fmaf(qh[4 * i], k.x, dot);
                dot = fmaf(qh[4 * i + 1], k.y, dot);
                dot = fmaf(qh[4 * i + 2], k.z, dot);
                dot = fmaf(qh[4 * i + 3], k.w, dot);
            }
            float v = live ? wh * fmaxf(dot, 0.0f) : 0.0f;
            v = warp_sum(v);
            if (lane == 0) store_float(logits, logits_dtype, out0 + j, v);
            __syncwarp();
        }
    }
}

// The entry points, one per query mode: each declares the block's key tile (a __shared__ inside
// the template would not be one variable per entry point on the host SIMT harness) and runs the
// body with its mode. Written out by name: build.rs and the launch-log check find each kernel by
// its own declaration, not through a macro.
#define INDEXER_POOL_ENTRY_BODY(QQ)                                                                        \
    {                                                                                                      \
        __shared__ float4 ks[WARPS][DIM / 4];                                                              \
        indexer_logits_pool<QQ>(q, q_dtype, w, w_dtype, pos, pos_i64, req, n_req, block_table, max_blocks, \
                                pool, block_stride, states, blocks, ratio, heads, logits, logits_dtype,    \
                                n_cols, rows, err, ks);                                                    \
    }
extern "C" __global__ void __launch_bounds__(CSA2_INDEXER_THREADS)
    indexer_logits_pool_f32_qnone(INDEXER_POOL_PARAMS) INDEXER_POOL_ENTRY_BODY(QQ_NONE)
extern "C" __global__ void __launch_bounds__(CSA2_INDEXER_THREADS)
    indexer_logits_pool_f32_qmxfp4(INDEXER_POOL_PARAMS) INDEXER_POOL_ENTRY_BODY(QQ_MXFP4)
extern "C" __global__ void __launch_bounds__(CSA2_INDEXER_THREADS)
    indexer_logits_pool_f32_qfp8(INDEXER_POOL_PARAMS) INDEXER_POOL_ENTRY_BODY(QQ_FP8)
extern "C" __global__ void __launch_bounds__(CSA2_INDEXER_THREADS)
    indexer_logits_pool_f32_qbf16(INDEXER_POOL_PARAMS) INDEXER_POOL_ENTRY_BODY(QQ_BF16)

// Expands a kept-block list (T, k) i32 (-1 padded; from kernels/topk.cu's candidate_blocks_f32)
// into a pool mask (T, mask_stride) u8. Launch: grid = T, block = 256.
extern "C" __global__ void candidate_mask_from_blocks(const i32* __restrict__ blocks, int k, u8* __restrict__ mask,
                                                      int mask_stride) {
    int t = blockIdx.x;
    for (int i = threadIdx.x; i < mask_stride; i += blockDim.x) mask[(i64)t * mask_stride + i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        i32 b = blocks[(i64)t * k + i];
        if (b >= 0 && b < mask_stride) mask[(i64)t * mask_stride + b] = 1;
    }
}
