// Top-k selection by radix select (docs/SPEC.md §2: the 512 largest logits, ties → smaller index),
// and the candidate pool's block selection over the same machinery (docs/SPEC.md §2.6).
//
// topk_f32: row t considers its first n = min(visible_t, n_cols) keys, where visible_t is
// n_valid[t] or, when n_valid is null, (positions[t] + 1) div ratio (positions i32 or i64:
// pos_i64). -Inf and NaN keys are never selected; -0 and +0 are one value (the index decides). If
// n ≤ k, the row selects 0..n-1 unconditionally (docs/SPEC.md §2.5: "if visible ≤ k, select all
// visible"). Otherwise it selects the k largest selectable keys (all of them if fewer than k are
// selectable) and writes them in the one order of src/ops/topk/mod.rs: logit descending, then
// index ascending, sorted in shared memory here (bitonic over (key, ~index) pairs), so no host
// step follows. The row is padded with -1; counts[t] (when not null) receives the number selected.
//
// candidate_blocks_f32: the same visible count n per row; block b covers entries
// [b·block_size, (b+1)·block_size) and scores the max of its logits (NaN ignored; every block
// before the newest is whole), the newest block ((n - 1) div block_size) is pinned (+Inf); the
// min(k, blocks) best blocks whose score is not -Inf are kept, sorted by (score desc, id asc), -1
// padded: src/ops/candidates/mod.rs's contract, with no "select all" shortcut (a short row is
// sorted too). Block scores are computed where they are read (no scratch buffer).
//
// A negative position selects nothing and is recorded once in err[4] = {1, row, 0, position}
// (first writer wins; the caller zeroes err and reads it whenever it syncs). No allocation, no host
// access: capturable in a CUDA graph.
//
// Launch: grid = T, block = 1024 (the code needs exactly 1024 threads); k ≤ CSA2_TOPK_SORT_MAX
// whenever a row scores (topk_f32: n > k; candidate_blocks_f32: always), checked by the launches in
// src/ops/topk/cuda.rs.
#include "common.cuh"

#define TPB CSA2_TOPK_THREADS
#define NWARP (TPB / 32)
#define SORT_MAX CSA2_TOPK_SORT_MAX
#if (SORT_MAX & (SORT_MAX - 1)) != 0
#error "topk_f32: the bitonic sort needs a power-of-two CSA2_TOPK_SORT_MAX"
#endif

// Order-preserving map f32 → u32 (larger float → larger key); -Inf and NaN → 0 (unselectable);
// -0 maps as +0 (one value, as the CPU's order).
__device__ __forceinline__ u32 sort_key(float f) {
    if (f != f || f == CSA2_NEG_INF) return 0u;
    u32 b = f == 0.0f ? 0u : __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive block scan of `v` (0/1 flags); returns this thread's prefix, writes the total.
__device__ __forceinline__ u32 block_exclusive_scan(u32 v, u32* warp_tot, u32* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 x = v;
    for (int o = 1; o < 32; o <<= 1) {
        u32 y = __shfl_up_sync(CSA2_FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_tot[warp] = x;
    __syncthreads();
    if (warp == 0) {
        u32 w = warp_tot[lane];
        u32 s = w;
        for (int o = 1; o < 32; o <<= 1) {
            u32 y = __shfl_up_sync(CSA2_FULL_MASK, s, o);
            if (lane >= o) s += y;
        }
        warp_tot[lane] = s - w;
        if (lane == 31) *total = s;
    }
    __syncthreads();
    u32 r = warp_tot[warp] + x - v;
    __syncthreads();
    return r;
}

// The visible entries of row t: n_valid[t], or (positions[t] + 1) div ratio (a negative position
// is recorded in err and sees nothing), clamped to 0..=n_cols.
__device__ __forceinline__ i64 row_visible(int t, int n_cols, const i32* __restrict__ n_valid,
                                           const void* __restrict__ positions, int pos_i64, int ratio,
                                           i32* __restrict__ err) {
    i64 n;
    if (n_valid) {
        n = n_valid[t];
    } else {
        i64 p = pos_i64 ? ((const i64*)positions)[t] : (i64)((const i32*)positions)[t];
        if (p < 0) {
            if (threadIdx.x == 0 && err && atomicCAS(&err[0], 0, 1) == 0) {
                err[1] = t;
                err[2] = 0;
                err[3] = (i32)p;
            }
            n = 0;
        } else {
            n = p / ratio + (p % ratio + 1) / ratio;  // (p + 1) div ratio without overflow
        }
    }
    if (n > n_cols) n = n_cols;
    if (n < 0) n = 0;
    return n;
}

// Shared memory of one row's selection.
struct SelectSmem {
    u32 hist[256];
    u32 warp_tot[32];
    u32 total;
    u32 prefix, need, zero;
    // The selection as (key << 32 | ~index): one descending sort gives (key desc, index asc).
    u64 sel[SORT_MAX];
};

// Selects the k (1 ≤ k ≤ SORT_MAX) largest non-zero keys of key_of(0 .. n) (ties → smaller
// index; all of them if fewer than k are non-zero) into o[0 .. k), sorted by (key desc, index
// asc), -1 padded; *count (when not null) receives the number selected. Every thread of the block
// calls it with the same arguments.
template <class KeyOf>
__device__ __forceinline__ void select_sorted(const KeyOf& key_of, i64 n, int k, i32* __restrict__ o,
                                              i32* __restrict__ count, SelectSmem& s) {
    int tid = threadIdx.x;
    // Radix select of the k-th largest key, 8 bits at a time from the top.
    u32 prefix = 0, need = (u32)k;
    if (tid == 0) s.zero = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += TPB) s.hist[i] = 0;
        __syncthreads();
        u32 hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        u32 zeros = 0;
        for (i64 i = tid; i < n; i += TPB) {
            u32 u = key_of(i);
            if (shift == 24 && u == 0) ++zeros;
            if (u != 0 && (u & hi_mask) == prefix) atomicAdd(&s.hist[(u >> shift) & 0xff], 1u);
        }
        if (shift == 24 && zeros) atomicAdd(&s.zero, zeros);
        __syncthreads();
        if (tid == 0) {
            if (shift == 24 && n - (i64)s.zero <= (i64)k) {
                s.need = 0xffffffffu;  // fewer selectable keys than k: take them all
            } else {
                u32 acc = 0;
                int bkt = 255;
                for (; bkt > 0; --bkt) {
                    if (acc + s.hist[bkt] >= need) break;
                    acc += s.hist[bkt];
                }
                s.prefix = prefix | ((u32)bkt << shift);
                s.need = need - acc;
            }
        }
        __syncthreads();
        if (s.need == 0xffffffffu) break;
        prefix = s.prefix;
        need = s.need;
        __syncthreads();
    }
    bool take_all = s.need == 0xffffffffu;
    u32 thr = prefix;  // the k-th largest key; `need` of its ties are taken, smallest index first

    // Compaction into shared memory, one tile of TPB keys at a time (in index order, so the ties
    // taken are the smallest indices).
    u32 out_base = 0, tie_base = 0;
    for (i64 base = 0; base < n; base += TPB) {
        i64 i = base + tid;
        u32 u = i < n ? key_of(i) : 0u;
        u32 gt = take_all ? (u != 0) : (u != 0 && u > thr);
        u32 eq = (!take_all && u != 0 && u == thr) ? 1u : 0u;
        u32 tie_rank = block_exclusive_scan(eq, s.warp_tot, &s.total);
        u32 tie_total = s.total;
        u32 take = gt || (eq && tie_base + tie_rank < need);
        u32 rank = block_exclusive_scan(take, s.warp_tot, &s.total);
        if (take) s.sel[out_base + rank] = ((u64)u << 32) | (u64)(~(u32)i);
        out_base += s.total;
        tie_base += tie_total;
    }
    // Bitonic sort, descending, over the next power of two; padding (0) sorts last.
    u32 m = 1;
    while (m < out_base) m <<= 1;
    for (u32 i = out_base + tid; i < m; i += TPB) s.sel[i] = 0ull;
    __syncthreads();
    for (u32 size = 2; size <= m; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            for (u32 i = tid; i < m; i += TPB) {
                u32 j = i ^ stride;
                if (j > i) {
                    u64 a = s.sel[i], b = s.sel[j];
                    bool desc = (i & size) == 0;
                    if (desc ? a < b : a > b) {
                        s.sel[i] = b;
                        s.sel[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (u32 i = tid; i < (u32)k; i += TPB) o[i] = i < out_base ? (i32)(~(u32)s.sel[i]) : -1;
    if (count && tid == 0) *count = (i32)out_base;
}

// The key of logit i of a row.
struct LogitKey {
    const float* __restrict__ row;
    __device__ __forceinline__ u32 operator()(i64 i) const { return sort_key(row[i]); }
};

extern "C" __global__ void __launch_bounds__(TPB) topk_f32(const float* __restrict__ keys, int n_cols,
                                                           const i32* __restrict__ n_valid,
                                                           const void* __restrict__ positions, int pos_i64,
                                                           int ratio, int k, i32* __restrict__ out,
                                                           i32* __restrict__ counts, i32* __restrict__ err) {
    __shared__ SelectSmem smem;
    int t = blockIdx.x, tid = threadIdx.x;
    i32* o = out + (i64)t * k;
    i64 n = row_visible(t, n_cols, n_valid, positions, pos_i64, ratio, err);
    if (n <= k) {
        for (int i = tid; i < k; i += TPB) o[i] = i < n ? i : -1;
        if (counts && tid == 0) counts[t] = (i32)n;
        return;
    }
    if (k == 0) {
        if (counts && tid == 0) counts[t] = 0;
        return;
    }
    select_sorted(LogitKey{keys + (i64)t * n_cols}, n, k, o, counts ? counts + t : nullptr, smem);
}

// The key of block b of a row whose newest visible block is `last`: the pinned block's is +Inf's,
// an older block's is its max logit's (all its entries are visible; fmaxf drops NaN, so a block
// of NaN / -Inf scores -Inf: key 0, never selected).
struct BlockKey {
    const float* __restrict__ row;
    i64 last;
    int bs;
    __device__ __forceinline__ u32 operator()(i64 b) const {
        if (b == last) return sort_key(CSA2_POS_INF);
        const float* p = row + b * bs;
        float m = CSA2_NEG_INF;
        // One loop for every block size: a branch unrolled for 8 spills on sm_100a (ptxas keeps
        // this kernel at 32 registers for 1024 threads).
        for (int i = 0; i < bs; ++i) m = fmaxf(m, p[i]);
        return sort_key(m);
    }
};

extern "C" __global__ void __launch_bounds__(TPB)
    candidate_blocks_f32(const float* __restrict__ logits, int n_cols, const i32* __restrict__ n_valid,
                         const void* __restrict__ positions, int pos_i64, int ratio, int k,
                         i32* __restrict__ out, i32* __restrict__ counts, i32* __restrict__ err,
                         int block_size) {
    __shared__ SelectSmem smem;
    int t = blockIdx.x, tid = threadIdx.x;
    i32* o = out + (i64)t * k;
    i64 n = row_visible(t, n_cols, n_valid, positions, pos_i64, ratio, err);
    i64 blocks = (n + block_size - 1) / block_size;
    if (blocks == 0 || k == 0) {
        for (int i = tid; i < k; i += TPB) o[i] = -1;
        if (counts && tid == 0) counts[t] = 0;
        return;
    }
    BlockKey key{logits + (i64)t * n_cols, blocks - 1, block_size};
    select_sorted(key, blocks, k, o, counts ? counts + t : nullptr, smem);
}
