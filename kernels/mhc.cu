// Fused Mega-mHC boundary for SM90 (docs/SPEC.md §4): one pass over the
// 4 hyper-connection streams does
//   1. post-mix of the previous sublayer:  X'_j = bf16(post_j · y + Σ_i C[i, j] · X_i)
//      (skipped when y is null: X' = X, nothing written — the first sublayer of the stack);
//   2. the next coefficients from X':  mix = (fn · vec(X')) · rsqrt(mean(X'²) + rms_eps),
//      pre = sigmoid(mix[0:4]·scale0 + base[0:4]) + hc_eps, post = post_mult·sigmoid(mix[4:8]·scale1 + base[4:8]),
//      C = sinkhorn_iters rounds of softmax_rows(mix[8:24]·scale2 + base[8:24]) + hc_eps (eps hc_eps);
//   3. the shifted collapse with the pre carried from the previous site and the sublayer RMSNorm:
//      u = bf16(Σ_i pre_carried_i · X'_i),  x_in = bf16(u · rsqrt(mean(u²) + rms_eps) · norm_w).
// The scalars (V4.1: post_mult 2, 20 iterations, hc_eps 1e-6, rms_eps 1e-20) and the stream count
// come from the geometry as build.rs defines (src/geometry/consts.rs).
// Streams and activations are bf16 (raw u16 bits); coefficients and parameters f32.
// Traffic per token: read y + X, write X' + x_in = (2n + 2)·d bf16 values (n = 4).
//
// Work split: one block per TOK tokens (the fn reads are shared by the tokens of a block); thread
// c-loop over columns. Launch: grid = ceil(T / 4), block = 256; d ≤ 5120.
#include "common.cuh"

#define NS CSA2_HC
#define NMIX CSA2_MIX
#define TOK CSA2_MHC_TOKENS_PER_BLOCK
#define THREADS CSA2_MHC_THREADS
#define MAX_D CSA2_HIDDEN_SIZE
#if NMIX != 2 * NS + NS * NS
#error "mHC: mix = pre (NS) + post (NS) + comb (NS x NS)"
#endif

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

extern "C" __global__ void __launch_bounds__(THREADS) mega_mhc_bf16(
    const u16* __restrict__ x, const u16* __restrict__ y, const float* __restrict__ post_prev,
    const float* __restrict__ comb_prev, const float* __restrict__ pre_carried, const float* __restrict__ fn,
    const float* __restrict__ base, const float* __restrict__ scale, const float* __restrict__ norm_w,
    u16* __restrict__ x_out, float* __restrict__ pre_out, float* __restrict__ post_out,
    float* __restrict__ comb_out, u16* __restrict__ x_in, int n_tokens, int d) {
    __shared__ u16 u_s[TOK][MAX_D];
    __shared__ float red[THREADS / 32][TOK][NMIX + 2];
    __shared__ float tot[TOK][NMIX + 2];
    // The block's coefficients, the same for every thread. Kept in registers (96 per thread) they
    // sat beside the 96 mix accumulators through the column loop and the kernel spilled (sm_80 to
    // sm_90a); shared memory holds them once per block.
    __shared__ float pp[TOK][NS];
    __shared__ float cp[TOK][NS * NS];
    __shared__ float pc[TOK][NS];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int t0 = blockIdx.x * TOK;
    int nt = n_tokens - t0 < TOK ? n_tokens - t0 : TOK;

    if (tid < TOK) {
        int k = tid;
        int t = k < nt ? t0 + k : t0;
        for (int i = 0; i < NS; ++i) {
            pp[k][i] = y ? post_prev[t * NS + i] : 0.0f;
            pc[k][i] = pre_carried[t * NS + i];
        }
        for (int i = 0; i < NS * NS; ++i) cp[k][i] = y ? comb_prev[t * NS * NS + i] : 0.0f;
    }
    __syncthreads();
    float acc[TOK][NMIX];
    float ssx[TOK], ssu[TOK];
    for (int k = 0; k < TOK; ++k) {
        ssx[k] = ssu[k] = 0.0f;
        for (int m = 0; m < NMIX; ++m) acc[k][m] = 0.0f;
    }

    for (int c = tid; c < d; c += THREADS) {
        float xp[TOK][NS];
        for (int k = 0; k < TOK; ++k) {
            if (k >= nt) {
                for (int j = 0; j < NS; ++j) xp[k][j] = 0.0f;
                continue;
            }
            i64 t = t0 + k;
            float xi[NS];
            for (int i = 0; i < NS; ++i) xi[i] = bf16_bits_to_f32(x[(t * NS + i) * d + c]);
            if (y) {
                float yv = bf16_bits_to_f32(y[t * d + c]);
                for (int j = 0; j < NS; ++j) {
                    float v = pp[k][j] * yv;
                    for (int i = 0; i < NS; ++i) v += cp[k][i * NS + j] * xi[i];
                    u16 b = f32_to_bf16_bits(v);
                    x_out[(t * NS + j) * d + c] = b;
                    xp[k][j] = bf16_bits_to_f32(b);
                }
            } else {
                for (int j = 0; j < NS; ++j) xp[k][j] = xi[j];
            }
            float u = 0.0f;
            for (int i = 0; i < NS; ++i) {
                u += pc[k][i] * xp[k][i];
                ssx[k] += xp[k][i] * xp[k][i];
            }
            u16 ub = f32_to_bf16_bits(u);
            u_s[k][c] = ub;
            float uf = bf16_bits_to_f32(ub);
            ssu[k] += uf * uf;
        }
        for (int m = 0; m < NMIX; ++m) {
            for (int i = 0; i < NS; ++i) {
                float f = fn[(i64)m * NS * d + (i64)i * d + c];
                for (int k = 0; k < TOK; ++k) acc[k][m] += f * xp[k][i];
            }
        }
    }

    // Deterministic block reduction of the 24 mix partials and the two sums of squares per token.
    // The loops index acc by a run-time (k, m), so acc goes through the stack frame here (416 B);
    // unrolled, the reduction keeps it in registers but spills on sm_100a.
    for (int k = 0; k < TOK; ++k) {
        for (int m = 0; m < NMIX + 2; ++m) {
            float v = m < NMIX ? acc[k][m] : (m == NMIX ? ssx[k] : ssu[k]);
            v = warp_sum(v);
            if (lane == 0) red[warp][k][m] = v;
        }
    }
    __syncthreads();
    if (tid < TOK * (NMIX + 2)) {
        int k = tid / (NMIX + 2), m = tid % (NMIX + 2);
        float s = 0.0f;
        for (int w = 0; w < THREADS / 32; ++w) s += red[w][k][m];
        tot[k][m] = s;
    }
    __syncthreads();

    // Coefficients (one thread per token; 4×4 Sinkhorn is too small to share).
    if (tid < nt) {
        int k = tid;
        i64 t = t0 + k;
        float r = 1.0f / sqrtf(tot[k][NMIX] / (float)(NS * d) + CSA2_RMS_NORM_EPS);
        float mix[NMIX];
        for (int m = 0; m < NMIX; ++m) mix[m] = tot[k][m] * r;
        for (int i = 0; i < NS; ++i) {
            pre_out[t * NS + i] = sigmoidf_(mix[i] * scale[0] + base[i]) + CSA2_HC_EPS;
            post_out[t * NS + i] = CSA2_HC_POST_MULT * sigmoidf_(mix[NS + i] * scale[1] + base[NS + i]);
        }
        float C[NS][NS];
        for (int i = 0; i < NS; ++i) {
            float mx = CSA2_NEG_INF;
            for (int j = 0; j < NS; ++j) {
                C[i][j] = mix[2 * NS + i * NS + j] * scale[2] + base[2 * NS + i * NS + j];
                mx = fmaxf(mx, C[i][j]);
            }
            float s = 0.0f;
            for (int j = 0; j < NS; ++j) {
                C[i][j] = expf(C[i][j] - mx);
                s += C[i][j];
            }
            for (int j = 0; j < NS; ++j) C[i][j] = C[i][j] / s + CSA2_HC_EPS;
        }
        for (int it = 0; it < CSA2_HC_SINKHORN_ITERS; ++it) {
            if (it > 0) {
                for (int i = 0; i < NS; ++i) {
                    float s = 0.0f;
                    for (int j = 0; j < NS; ++j) s += C[i][j];
                    for (int j = 0; j < NS; ++j) C[i][j] /= (s + CSA2_HC_EPS);
                }
            }
            for (int j = 0; j < NS; ++j) {
                float s = 0.0f;
                for (int i = 0; i < NS; ++i) s += C[i][j];
                for (int i = 0; i < NS; ++i) C[i][j] /= (s + CSA2_HC_EPS);
            }
        }
        for (int i = 0; i < NS; ++i)
            for (int j = 0; j < NS; ++j) comb_out[t * NS * NS + i * NS + j] = C[i][j];
    }

    // Sublayer input: RMSNorm of the collapse.
    for (int k = 0; k < nt; ++k) {
        float ru = 1.0f / sqrtf(tot[k][NMIX + 1] / (float)d + CSA2_RMS_NORM_EPS);
        i64 t = t0 + k;
        for (int c = tid; c < d; c += THREADS)
            x_in[t * d + c] = f32_to_bf16_bits(bf16_bits_to_f32(u_s[k][c]) * ru * norm_w[c]);
    }
}
