// Compressor (docs/SPEC.md §2), fused with the main-KV and index-K cache writes.
//
// Per compressed entry j of a request (covering tokens [j·m, j·m + m)):
//   ratio 2: w0 = softmax(score0, score1)[0] per channel; pooled = w0·kv0 + (1 − w0)·kv1
//   ratio 1: pooled = kv
//   latent  = bf16(RMSNorm(pooled, norm_w))                           (eps rms_norm_eps)
//   main KV = NVFP4-DS(RoPE(latent, dims 448..511, position j·m))      → main pages
//   index K = MXFP4(RoPE(RMSNorm(wk · latent, k_norm_w), dims 64..127, position j·m)) → index pages
// The half-finished pair of a ratio-2 layer is carried between calls in `state` (kv ‖ score, and the
// carried token's position, -1 = none). RoPE angles are computed in f64 (position · inv_freq) so
// positions near 1M keep full precision; cos / sin are then rounded to f32.
//
// Launch: grid = (max entries of any request + 1, n_requests), block = 128. Block x = 0 also writes
// the outgoing carry state; state_in and state_out must not alias. Entry j is stored through block
// table column (j - table_base) / page_slots: 0 for a request's own table (entry ids from 0); the
// flat row form (one request, pages of one slot = the output rows) passes its first entry, so its
// table spans only the entries of the call.
#include "common.cuh"

#define KV CSA2_KV_DIM
#define IDX CSA2_INDEX_DIM
#define THREADS CSA2_COMPRESSOR_THREADS
#define ROPE_PAIRS (CSA2_ROPE_DIM / 2)
// One thread per index-K dim; the first 2 · ROPE_PAIRS threads rotate; warps 0 and 1 encode.
#if THREADS != IDX || IDX % 32 != 0 || 2 * ROPE_PAIRS > THREADS || KV % 128 != 0 || IDX % 128 != 0
#error "compressor: one thread per index-K dim, 32 index-K outputs per warp"
#endif

__device__ __forceinline__ void rope_pair(float* x, int i, i64 pos, const double* inv_freq, float sign) {
    double ang = (double)pos * inv_freq[i];
    float c = (float)cos(ang), s = sign * (float)sin(ang);
    float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
}

extern "C" __global__ void compressor_f32(
    const float* __restrict__ kv, const float* __restrict__ score, const i32* __restrict__ cu_tokens,
    const i32* __restrict__ start_pos, const float* __restrict__ state_in, const i32* __restrict__ state_pos_in,
    float* __restrict__ state_out, i32* __restrict__ state_pos_out, const float* __restrict__ norm_w,
    const float* __restrict__ wk, const float* __restrict__ k_norm_w, const double* __restrict__ inv_freq,
    const i32* __restrict__ block_table, int max_blocks, int page_slots, u8* __restrict__ main_pages,
    u8* __restrict__ index_pages, int ratio, i64 table_base) {
    __shared__ float lat[KV];
    __shared__ float kidx[IDX];
    __shared__ float red[32];
    int r = blockIdx.y, tid = threadIdx.x;
    i64 t0 = cu_tokens[r], len = cu_tokens[r + 1] - t0, s = start_pos[r];

    if (ratio == 2 && blockIdx.x == 0) {
        // Outgoing carry: the last token when its position is even (its pair is not complete).
        i64 last = s + len - 1;
        bool carry = len > 0 && (last % 2 == 0);
        for (int c = tid; c < KV; c += THREADS) {
            float kvv = 0.0f, scv = 0.0f;
            if (carry) {
                kvv = kv[(t0 + len - 1) * KV + c];
                scv = score[(t0 + len - 1) * KV + c];
            } else if (len == 0) {
                kvv = state_in[(i64)r * 2 * KV + c];
                scv = state_in[(i64)r * 2 * KV + KV + c];
            }
            state_out[(i64)r * 2 * KV + c] = kvv;
            state_out[(i64)r * 2 * KV + KV + c] = scv;
        }
        if (tid == 0) state_pos_out[r] = carry ? (i32)last : (len == 0 ? state_pos_in[r] : -1);
    }

    i64 j_lo = s / ratio, j_hi = (s + len) / ratio;
    i64 j = j_lo + blockIdx.x;
    if (j >= j_hi) return;

    // 1. pooled → RMSNorm → bf16 latent.
    float ss = 0.0f;
    for (int c = tid; c < KV; c += THREADS) {
        float p;
        if (ratio == 1) {
            p = kv[(t0 + (j - s)) * KV + c];
        } else {
            i64 p0 = 2 * j;
            float k0, s0;
            if (p0 < s) {
                k0 = state_in[(i64)r * 2 * KV + c];
                s0 = state_in[(i64)r * 2 * KV + KV + c];
            } else {
                k0 = kv[(t0 + (p0 - s)) * KV + c];
                s0 = score[(t0 + (p0 - s)) * KV + c];
            }
            float k1 = kv[(t0 + (p0 + 1 - s)) * KV + c];
            float s1 = score[(t0 + (p0 + 1 - s)) * KV + c];
            float m = fmaxf(s0, s1);
            float e0 = expf(s0 - m), e1 = expf(s1 - m);
            float w0 = e0 / (e0 + e1);
            p = w0 * k0 + (1.0f - w0) * k1;
        }
        lat[c] = p;
        ss += p * p;
    }
    ss = block_sum(ss, red);
    float rinv = 1.0f / sqrtf(ss / (float)KV + CSA2_RMS_NORM_EPS);
    for (int c = tid; c < KV; c += THREADS) lat[c] = bf16_round(lat[c] * rinv * norm_w[c]);
    __syncthreads();

    // 2. index K = wk · latent (warp w computes outputs [32w, 32w + 32)), from the un-rotated latent.
    int lane = tid & 31, warp = tid >> 5;
    for (int o = warp * 32; o < warp * 32 + 32; ++o) {
        const float* wr = wk + (i64)o * KV;
        float acc = 0.0f;
        for (int c = lane; c < KV; c += 32) acc += wr[c] * lat[c];
        acc = warp_sum(acc);
        if (lane == 0) kidx[o] = acc;
    }
    __syncthreads();
    float kss = block_sum(kidx[tid] * kidx[tid], red);
    float krinv = 1.0f / sqrtf(kss / (float)IDX + CSA2_RMS_NORM_EPS);
    kidx[tid] = kidx[tid] * krinv * k_norm_w[tid];
    __syncthreads();

    // 3. RoPE at the group's first token (the last ROPE_DIM dims of the latent and of index K).
    i64 pos = j * ratio;
    if (tid < ROPE_PAIRS) rope_pair(lat + (KV - CSA2_ROPE_DIM), tid, pos, inv_freq, 1.0f);
    else if (tid < 2 * ROPE_PAIRS) rope_pair(kidx + (IDX - CSA2_ROPE_DIM), tid - ROPE_PAIRS, pos, inv_freq, 1.0f);
    __syncthreads();

    // 4. Quantize into the pages: warp 0 → main KV, warp 1 → index K.
    i64 slot = table_slot(block_table + (i64)r * max_blocks, max_blocks, j - table_base, page_slots);
    if (slot < 0) return;
    if (warp == 0) {
        SlotPtr p = slot_ptr(main_pages, slot, page_slots, CSA2_NVFP4_DATA, CSA2_NVFP4_SCALE);
        warp_encode_nvfp4(lat, p.data, p.scale);
    } else if (warp == 1) {
        SlotPtr p = slot_ptr(index_pages, slot, page_slots, CSA2_MXFP4_INDEX_DATA, CSA2_MXFP4_INDEX_SCALE);
        warp_encode_mxfp4(kidx, IDX / 128, p.data, p.scale);
    }
}
