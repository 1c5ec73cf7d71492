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

#define D 512
#define HEADS 64
#define GROUP 16
#define PARTS 16
#define PER (D / PARTS)
#define KT 16
#define WINDOW 128

extern "C" __global__ void __launch_bounds__(256, 1) sparse_decode_attn_f32(
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
    // Group leader lane within the warp (16 threads per head, two heads per warp).
    int leader = (tid & 31) & ~(PARTS - 1);

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
                SlotPtr sp = slot_ptr((u8*)main_pages, slot, main_page_slots, 256, 32);
                float s0 = e4m3_decode(sp.scale[2 * c]), s1 = e4m3_decode(sp.scale[2 * c + 1]);
                const u8* d = sp.data + 16 * c;
                for (int i = 0; i < 16; ++i) {
                    u32 b = d[i];
                    float s = i < 8 ? s0 : s1;
                    dst[2 * i] = e2m1_decode(b & 0xf) * s;
                    dst[2 * i + 1] = e2m1_decode(b >> 4) * s;
                }
            } else {
                SlotPtr sp = slot_ptr((u8*)swa_pages, slot, swa_page_slots, 512, 16);
                float s = e8m0_decode(sp.scale[c]);
                const u8* d = sp.data + 32 * c;
                for (int i = 0; i < 32; ++i) dst[i] = e4m3_decode(d[i]) * s;
            }
        }
        __syncthreads();
        // Scores of this tile for head h (reduced over the 16 parts, then broadcast from the leader).
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
        if (tmax == CSA2_NEG_INF) continue;
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

    // Sink in the denominator only; empty rows stay zero.
    float lse_h = CSA2_NEG_INF;
    if (m != CSA2_NEG_INF) {
        float sk = sink ? sink[h] : CSA2_NEG_INF;
        float M = fmaxf(m, sk);
        float a = expf(m - M);
        float denom = l * a + expf(sk - M);
        float f = a / denom;
#pragma unroll
        for (int i = 0; i < PER; ++i) o[i] *= f;
        lse_h = m + logf(l);
    }
    __syncthreads();
    // Stage the 16 heads' outputs through shared memory (ks is exactly 16 × 512) for the inverse RoPE.
#pragma unroll
    for (int i = 0; i < PER; ++i) ks[hl][i * PARTS + part] = o[i];
    __syncthreads();
    float* oh = out + ((i64)t * HEADS + blockIdx.x * GROUP) * D;
    for (int idx = tid; idx < GROUP * D; idx += 256) {
        int hh = idx / D, d = idx % D;
        float v = ks[hh][d];
        if (inv_freq && d >= 448) {
            int pi = (d - 448) / 2;
            double ang = (double)p * inv_freq[pi];
            float c = (float)cos(ang), s = (float)sin(ang);
            float a = ks[hh][448 + 2 * pi], b = ks[hh][449 + 2 * pi];
            v = (d & 1) == 0 ? a * c + b * s : -a * s + b * c;
        }
        oh[(i64)hh * D + d] = v;
    }
    if (part == 0) lse[(i64)t * HEADS + h] = lse_h;
}

// ---- attention over vLLM's strided page pools (issue 15; src/ops/attention/pools.rs) ------------
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

#define CSA2_FMT_NVFP4 0
#define CSA2_FMT_MXFP8 2
#define CSA2_FMT_V4 3

// Dims [32c, 32c + 32) of the record at `sp` in format `fmt` (exact: E2M1·E4M3, E4M3·2^e and
// bf16 values are all f32).
__device__ __forceinline__ void dequant32(SlotPtr sp, int fmt, int c, float* dst) {
    if (fmt == CSA2_FMT_NVFP4) {  // 256 B E2M1 pairs (even element low), 32 E4M3 scales per 16
        float s0 = e4m3_decode(sp.scale[2 * c]), s1 = e4m3_decode(sp.scale[2 * c + 1]);
        const u8* d = sp.data + 16 * c;
        for (int i = 0; i < 16; ++i) {
            u32 b = d[i];
            float s = i < 8 ? s0 : s1;
            dst[2 * i] = e2m1_decode(b & 0xf) * s;
            dst[2 * i + 1] = e2m1_decode(b >> 4) * s;
        }
    } else if (fmt == CSA2_FMT_MXFP8) {  // 512 E4M3, 16 UE8M0 per 32
        float s = e8m0_decode(sp.scale[c]);
        const u8* d = sp.data + 32 * c;
        for (int i = 0; i < 32; ++i) dst[i] = e4m3_decode(d[i]) * s;
    } else if (c < 14) {  // V4: 448 E4M3 NoPE dims, 7 UE8M0 per 64
        float s = e8m0_decode(sp.scale[c / 2]);
        const u8* d = sp.data + 32 * c;
        for (int i = 0; i < 32; ++i) dst[i] = e4m3_decode(d[i]) * s;
    } else {  // V4: dims 448..511 are bf16 (little-endian) at byte 448 + 2·(dim − 448)
        const u8* d = sp.data + 448 + 64 * (c - 14);
        for (int i = 0; i < 32; ++i) dst[i] = bf16_bits_to_f32((u16)(d[2 * i] | (d[2 * i + 1] << 8)));
    }
}

__device__ __forceinline__ int fmt_data_bytes(int fmt) {
    return fmt == CSA2_FMT_NVFP4 ? 256 : fmt == CSA2_FMT_MXFP8 ? 512 : 576;
}
__device__ __forceinline__ int fmt_scale_bytes(int fmt) {
    return fmt == CSA2_FMT_NVFP4 ? 32 : fmt == CSA2_FMT_MXFP8 ? 16 : 8;
}

extern "C" __global__ void __launch_bounds__(256, 1) attn_pools_bf16(
    const u16* __restrict__ q, int hp, int n_heads,
    const i32* __restrict__ main_idx, int km, const i32* __restrict__ main_len,
    const u8* __restrict__ main_pool, i64 main_stride, int main_states, i64 main_blocks, int main_fmt,
    int main_layout,
    const i32* __restrict__ swa_idx, int ks, const i32* __restrict__ swa_len,
    const u8* __restrict__ swa_pool, i64 swa_stride, int swa_states, i64 swa_blocks, int swa_fmt,
    int swa_layout,
    const float* __restrict__ sink, float scale, u16* __restrict__ out, float* __restrict__ lse,
    i32* __restrict__ err) {
    __shared__ float ks_s[KT][D];
    __shared__ i64 slot_s[KT];
    __shared__ int kind_s[KT];
    __shared__ float z_s[GROUP][KT];
    int t = blockIdx.y, tid = threadIdx.x;
    int hl = tid / PARTS, part = tid % PARTS, h = blockIdx.x * GROUP + hl;
    int nm = main_len ? main_len[t] : km;
    nm = nm < 0 ? 0 : (nm > km ? km : nm);
    int ns = swa_len ? swa_len[t] : ks;
    ns = ns < 0 ? 0 : (ns > ks ? ks : ns);
    int n_keys = nm + ns;
    i64 main_cap = main_pool ? main_blocks * (i64)main_states : 0;
    i64 swa_cap = swa_blocks * (i64)swa_states;
    bool live = h < n_heads;

    float qr[PER], o[PER];
    const u16* qh = q + ((i64)t * hp + h) * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        qr[i] = live ? bf16_bits_to_f32(qh[i * PARTS + part]) : 0.0f;
        o[i] = 0.0f;
    }
    float m = CSA2_NEG_INF, l = 0.0f;
    int leader = (tid & 31) & ~(PARTS - 1);

    for (int k0 = 0; k0 < n_keys; k0 += KT) {
        __syncthreads();
        if (tid < KT) {
            int k = k0 + tid;
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
            slot_s[tid] = slot;
            kind_s[tid] = kind;
        }
        __syncthreads();
        {
            int kk = tid / 16, c = tid % 16;
            i64 slot = slot_s[kk];
            float* dst = &ks_s[kk][32 * c];
            if (slot < 0) {
                for (int i = 0; i < 32; ++i) dst[i] = 0.0f;
            } else if (kind_s[kk] == 1) {
                SlotPtr sp = pool_slot_ptr((u8*)main_pool, main_stride, slot, main_states,
                                           fmt_data_bytes(main_fmt), fmt_scale_bytes(main_fmt), main_layout);
                dequant32(sp, main_fmt, c, dst);
            } else {
                SlotPtr sp = pool_slot_ptr((u8*)swa_pool, swa_stride, slot, swa_states,
                                           fmt_data_bytes(swa_fmt), fmt_scale_bytes(swa_fmt), swa_layout);
                dequant32(sp, swa_fmt, c, dst);
            }
        }
        __syncthreads();
        float tmax = CSA2_NEG_INF;
#pragma unroll 1
        for (int kk = 0; kk < KT; ++kk) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < PER; ++i) acc += qr[i] * ks_s[kk][i * PARTS + part];
            for (int off = PARTS / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(CSA2_FULL_MASK, acc, off);
            acc = __shfl_sync(CSA2_FULL_MASK, acc, leader);
            bool valid = (k0 + kk) < n_keys && slot_s[kk] >= 0;
            float zk = valid ? acc * scale : CSA2_NEG_INF;
            if (part == 0) z_s[hl][kk] = zk;
            tmax = fmaxf(tmax, zk);
        }
        __syncwarp();
        if (tmax == CSA2_NEG_INF) continue;
        float m_new = fmaxf(m, tmax);
        float corr = expf(m - m_new);
        l *= corr;
#pragma unroll
        for (int i = 0; i < PER; ++i) o[i] *= corr;
#pragma unroll 1
        for (int kk = 0; kk < KT; ++kk) {
            float pk = expf(z_s[hl][kk] - m_new);
            l += pk;
#pragma unroll
            for (int i = 0; i < PER; ++i) o[i] += pk * ks_s[kk][i * PARTS + part];
        }
        m = m_new;
    }

    float lse_h = CSA2_NEG_INF;
    if (m != CSA2_NEG_INF) {
        float sk = (sink && live) ? sink[h] : CSA2_NEG_INF;
        float M = fmaxf(m, sk);
        float a = expf(m - M);
        float f = a / (l * a + expf(sk - M));
#pragma unroll
        for (int i = 0; i < PER; ++i) o[i] *= f;
        lse_h = m + logf(l);
    }
    u16* oh = out + ((i64)t * hp + h) * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) oh[i * PARTS + part] = live ? f32_to_bf16_bits(o[i]) : (u16)0;
    if (part == 0 && live && lse) lse[(i64)t * n_heads + h] = lse_h;
}
