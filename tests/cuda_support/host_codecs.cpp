// Compiles kernels/common.cuh as HOST code (shims below stand in for the CUDA intrinsics it uses)
// so the device codecs can be compared bit for bit with src/formats/scalar.rs on a machine without a
// GPU. Reads little-endian u32 words on stdin; for each word w (taken as f32 bits x) writes 20 bytes:
//   e2m1_encode_sw(x), e4m3_encode(x), (ceil_log2(x) + 200) mod 256, 0, then the f32 bits (LE) of
//   bf16_round(x), e4m3_decode(w & 0xff), e2m1_decode(w & 0xf), e8m0_decode(w & 0xff).
// The codec bodies are the device source, untouched; only the intrinsics are shimmed.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#define __device__
#define __forceinline__ inline
#define __restrict__
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __fdiv_rn(float a, float b) { return a / b; }  // IEEE division on the host
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
// Warp / block primitives are not exercised by the scalar codecs; they only need to parse.
#define __shfl_xor_sync(m, v, o) (v)
#define __shfl_sync(m, v, l) (v)
#define __syncthreads() ((void)0)
static struct { unsigned x; } threadIdx, blockDim;

#include "../../kernels/common.cuh"

int main() {
    unsigned bits;
    while (std::fread(&bits, 4, 1, stdin) == 1) {
        float x = __uint_as_float(bits);
        unsigned char o[20];
        o[0] = (unsigned char)e2m1_encode_sw(x);
        o[1] = (unsigned char)e4m3_encode(x);
        o[2] = (unsigned char)(ceil_log2(x) + 200);
        o[3] = 0;
        unsigned r[4] = {__float_as_uint(bf16_round(x)), __float_as_uint(e4m3_decode(bits & 0xff)),
                         __float_as_uint(e2m1_decode(bits & 0xf)), __float_as_uint(e8m0_decode(bits & 0xff))};
        std::memcpy(o + 4, r, 16);
        std::fwrite(o, 1, 20, stdout);
    }
    return 0;
}
