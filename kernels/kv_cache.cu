// KV record encode / decode straight into block-planar cache pages through a slot mapping
// (docs/SPEC.md §1; vLLM `reshape_and_cache` convention: slot = block · page_slots + offset, -1 = skip).
//
// One warp per row; a block of 4 warps. Launch: grid = ceil(n_rows / 4), block = 128.
#include "common.cuh"

#define ROWS_PER_BLOCK CSA2_KV_ROWS_PER_BLOCK
#if CSA2_KV_THREADS != 32 * ROWS_PER_BLOCK
#error "kv_cache: one warp per row"
#endif

// x: (n_rows, KV_DIM) f32 → NVFP4-DS main-KV records (288 B) in `pages`.
extern "C" __global__ void nvfp4ds_encode_f32(const float* __restrict__ x, const i64* __restrict__ slot_mapping,
                                              u8* __restrict__ pages, int n_rows, int page_slots) {
    int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    i64 slot = slot_mapping[row];
    if (slot < 0) return;
    SlotPtr p = slot_ptr(pages, slot, page_slots, CSA2_NVFP4_DATA, CSA2_NVFP4_SCALE);
    warp_encode_nvfp4(x + (i64)row * CSA2_KV_DIM, p.data, p.scale);
}

// x: (n_rows, INDEX_DIM) f32 → MXFP4 index-K records (68 B).
extern "C" __global__ void mxfp4_index_encode_f32(const float* __restrict__ x, const i64* __restrict__ slot_mapping,
                                                  u8* __restrict__ pages, int n_rows, int page_slots) {
    int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    i64 slot = slot_mapping[row];
    if (slot < 0) return;
    SlotPtr p = slot_ptr(pages, slot, page_slots, CSA2_MXFP4_INDEX_DATA, CSA2_MXFP4_INDEX_SCALE);
    warp_encode_mxfp4(x + (i64)row * CSA2_INDEX_DIM, CSA2_INDEX_DIM / 128, p.data, p.scale);
}

// x: (n_rows, KV_DIM) f32 → MXFP8 SWA records (528 B).
extern "C" __global__ void mxfp8_encode_f32(const float* __restrict__ x, const i64* __restrict__ slot_mapping,
                                            u8* __restrict__ pages, int n_rows, int page_slots) {
    int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    i64 slot = slot_mapping[row];
    if (slot < 0) return;
    SlotPtr p = slot_ptr(pages, slot, page_slots, CSA2_MXFP8_DATA, CSA2_MXFP8_SCALE);
    warp_encode_mxfp8(x + (i64)row * CSA2_KV_DIM, p.data, p.scale);
}

// Gather-decode: out (n_rows, KV_DIM | INDEX_DIM) f32 from the records at `slot_mapping`; slot -1 → zeros.
// `format`: CSA2_FMT_NVFP4, CSA2_FMT_MXFP4_INDEX or CSA2_FMT_MXFP8.
extern "C" __global__ void kv_decode_f32(const u8* __restrict__ pages, const i64* __restrict__ slot_mapping,
                                         float* __restrict__ out, int n_rows, int page_slots, int format) {
    int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= n_rows) return;
    int dim = format == CSA2_FMT_MXFP4_INDEX ? CSA2_INDEX_DIM : CSA2_KV_DIM;
    float* o = out + (i64)row * dim;
    i64 slot = slot_mapping[row];
    if (slot < 0) {
        for (int i = lane; i < dim; i += 32) o[i] = 0.0f;
        return;
    }
    if (format == CSA2_FMT_NVFP4) {
        SlotPtr p = slot_ptr((u8*)pages, slot, page_slots, CSA2_NVFP4_DATA, CSA2_NVFP4_SCALE);
        for (int i = lane; i < CSA2_NVFP4_DATA; i += 32) {
            float s = e4m3_decode(p.scale[i / 8]);
            u32 b = p.data[i];
            o[2 * i] = e2m1_decode(b & 0xf) * s;
            o[2 * i + 1] = e2m1_decode(b >> 4) * s;
        }
    } else if (format == CSA2_FMT_MXFP4_INDEX) {
        SlotPtr p = slot_ptr((u8*)pages, slot, page_slots, CSA2_MXFP4_INDEX_DATA, CSA2_MXFP4_INDEX_SCALE);
        for (int i = lane; i < CSA2_MXFP4_INDEX_DATA; i += 32) {
            float s = e8m0_decode(p.scale[i / 16]);
            u32 b = p.data[i];
            o[2 * i] = e2m1_decode(b & 0xf) * s;
            o[2 * i + 1] = e2m1_decode(b >> 4) * s;
        }
    } else {
        SlotPtr p = slot_ptr((u8*)pages, slot, page_slots, CSA2_MXFP8_DATA, CSA2_MXFP8_SCALE);
        for (int i = lane; i < CSA2_MXFP8_DATA; i += 32) o[i] = e4m3_decode(p.data[i]) * e8m0_decode(p.scale[i / 32]);
    }
}
