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

// Block scores of the candidate pool: score[t, b] = max of logits[t, CB·b .. CB·b + CB) over visible
// entries; the block holding the newest visible entry is pinned to +Inf; blocks past the last one
// are -Inf. n_valid: (T,) visible entries; blocks_valid: (T,) out, the visible blocks ceil(n / 8)
// (the n_valid of the top-k that follows): blocks of CB entries. Launch: grid = (ceil(n_blocks / 256), T), block = 256.
extern "C" __global__ void candidate_block_scores_f32(const float* __restrict__ logits, int n_cols,
                                                      const i32* __restrict__ n_valid,
                                                      float* __restrict__ block_scores, int n_blocks,
                                                      i32* __restrict__ blocks_valid) {
    int t = blockIdx.y;
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    i64 n = n_valid[t] < n_cols ? n_valid[t] : n_cols;
    if (n < 0) n = 0;
    if (b == 0) blocks_valid[t] = (i32)((n + CB - 1) / CB);
    if (b >= n_blocks) return;
    i64 last = n > 0 ? (n - 1) / CB : -1;
    float m = CSA2_NEG_INF;
    if (b == last) {
        m = CSA2_POS_INF;
    } else if (b < last) {
        for (int i = 0; i < CB; ++i) m = fmaxf(m, logits[(i64)t * n_cols + CB * (i64)b + i]);
    }
    block_scores[(i64)t * n_blocks + b] = m;
}

// Expands a kept-block list (T, k) i32 (-1 padded; from topk over block scores) into a pool mask
// (T, mask_stride) u8. Launch: grid = T, block = 256.
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
