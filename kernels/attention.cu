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
#define TC_KS (D + 8)  // bf16 row stride of the key tile (pads rows onto different banks)

__device__ __forceinline__ void mma_bf16_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                               u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)f32_to_bf16_bits(lo) | ((u32)f32_to_bf16_bits(hi) << 16);
}

extern "C" __global__ void __launch_bounds__(256, 1) attn_pools_bf16_mma(
    const u16* __restrict__ q, int hp, int n_heads,
    const i32* __restrict__ main_idx, int km, const i32* __restrict__ main_len,
    const u8* __restrict__ main_pool, i64 main_stride, int main_states, i64 main_blocks, int main_fmt,
    int main_layout,
    const i32* __restrict__ swa_idx, int ks, const i32* __restrict__ swa_len,
    const u8* __restrict__ swa_pool, i64 swa_stride, int swa_states, i64 swa_blocks, int swa_fmt,
    int swa_layout,
    const float* __restrict__ sink, float scale, u16* __restrict__ out, float* __restrict__ lse,
    i32* __restrict__ err) {
    __shared__ __align__(16) u16 kt[TC_KT * TC_KS];
    __shared__ i64 slot_s[TC_KT];
    __shared__ int kind_s[TC_KT];
    int t = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, tg = lane & 3;
    int h0 = blockIdx.x * 64 + (warp & 3) * 16;  // first head of this warp's tile
    int d0 = (warp >> 2) * 256;                  // first output dim of this warp
    int nm = main_len ? main_len[t] : km;
    nm = nm < 0 ? 0 : (nm > km ? km : nm);
    int ns = swa_len ? swa_len[t] : ks;
    ns = ns < 0 ? 0 : (ns > ks ? ks : ns);
    int n_keys = nm + ns;
    i64 main_cap = main_pool ? main_blocks * (i64)main_states : 0;
    i64 swa_cap = swa_blocks * (i64)swa_states;
    // Rows g and g + 8 of the head tile; heads past hp do not exist (hp is 64 or 128).
    const u16* q0 = q + ((i64)t * hp + h0 + g) * D;
    const u16* q1 = q0 + 8 * D;
    float o[32][4];
#pragma unroll
    for (int n = 0; n < 32; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = CSA2_NEG_INF, m1 = CSA2_NEG_INF, l0 = 0.0f, l1 = 0.0f;

    for (int k0 = 0; k0 < n_keys; k0 += TC_KT) {
        __syncthreads();
        if (tid < TC_KT) {
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
            float f[32];  // this thread's 32 dims of its key, then converted to bf16 (exact)
            if (slot < 0) {
                for (int i = 0; i < 32; ++i) f[i] = 0.0f;
            } else if (kind_s[kk] == 1) {
                dequant32(pool_slot_ptr((u8*)main_pool, main_stride, slot, main_states,
                                        fmt_data_bytes(main_fmt), fmt_scale_bytes(main_fmt), main_layout),
                          main_fmt, c, f);
            } else {
                dequant32(pool_slot_ptr((u8*)swa_pool, swa_stride, slot, swa_states,
                                        fmt_data_bytes(swa_fmt), fmt_scale_bytes(swa_fmt), swa_layout),
                          swa_fmt, c, f);
            }
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
        for (int n = 0; n < 32; ++n) {
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
    if (m0 != CSA2_NEG_INF) {
        float sk = (sink && ha < n_heads) ? sink[ha] : CSA2_NEG_INF;
        float M = fmaxf(m0, sk), a = expf(m0 - M);
        f0 = a / (l0 * a + expf(sk - M));
    }
    if (m1 != CSA2_NEG_INF) {
        float sk = (sink && hb < n_heads) ? sink[hb] : CSA2_NEG_INF;
        float M = fmaxf(m1, sk), a = expf(m1 - M);
        f1 = a / (l1 * a + expf(sk - M));
    }
    u16* oa = out + ((i64)t * hp + ha) * D + d0;
    u16* ob = out + ((i64)t * hp + hb) * D + d0;
    bool la = ha < n_heads, lb = hb < n_heads;
#pragma unroll
    for (int n = 0; n < 32; ++n) {
        int c = n * 8 + 2 * tg;
        *(u32*)(oa + c) = la ? pack_bf16x2(o[n][0] * f0, o[n][1] * f0) : 0u;
        *(u32*)(ob + c) = lb ? pack_bf16x2(o[n][2] * f1, o[n][3] * f1) : 0u;
    }
    if (d0 == 0 && tg == 0 && lse) {
        if (la) lse[(i64)t * n_heads + ha] = m0 == CSA2_NEG_INF ? CSA2_NEG_INF : m0 + logf(l0);
        if (lb) lse[(i64)t * n_heads + hb] = m1 == CSA2_NEG_INF ? CSA2_NEG_INF : m1 + logf(l1);
    }
}
