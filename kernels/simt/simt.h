// The host SIMT harness: the CUDA vocabulary the csa2 kernels use, defined for a host C++20
// compiler, so that kernels/*.cu compile unchanged as ordinary C++ and run on the CPU.
//
// build.rs force-includes this header (`-include simt/simt.h -x c++`) when feature `cuda-emu` is
// on; src/cuda/emu.rs loads the result like a CUDA module and launches it through the same launch
// code as a GPU. The execution model (runtime.cpp): every CUDA thread of a block is a fiber; a
// block's fibers run on one OS thread, each until it blocks at a barrier, a shuffle or an mma, in
// thread order; the blocks of a grid run one after another. `__shared__` variables live in one
// section per module, filled with 0xFF before every block. See docs/ARCHITECTURE.md § "The host SIMT
// harness" for what this models and what it cannot.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define CSA2_SIMT_HOST 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One section per module: the runtime finds it (__start_/__stop_) and poisons it before each block.
#define __shared__ static __attribute__((section("csa2_simt_shared"), used))

namespace csa2_simt {

struct Dim3 {
    unsigned x, y, z;
};

// What a fiber knows about itself (the CUDA builtins read it).
struct ThreadState {
    Dim3 thread_idx;
    Dim3 block_idx;
    Dim3 block_dim;
    Dim3 grid_dim;
};

// The running fiber's builtins (thread-local: each OS thread runs at most one block at a time).
const ThreadState& self();

void sync_block();
void sync_warp(unsigned mask);

enum class ShflMode { Idx, Xor, Up, Down };
uint64_t shfl(unsigned mask, uint64_t bits, ShflMode mode, int arg, int width);

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for the calling lane (warp-collective).
void mma_m16n8k16_bf16_f32(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                           uint32_t b1);

// cp.async (global → shared, sm_80+) for the calling thread: the copy is queued and its destination
// poisoned (0xFF bytes) at issue; cp_async_commit closes the thread's open copies into a group;
// cp_async_wait(n) performs the thread's oldest committed groups until at most n remain. A read of
// the destination before the wait that covers it therefore sees the poison, and a copy still queued
// when its thread returns is dropped (its block's shared memory dies with it).
void cp_async(void* dst, const void* src, unsigned bytes);
void cp_async_commit();
void cp_async_wait(int n);

// cvt.rn.satfinite.e2m1x2.f32 d, a, b: a's code in bits 4..7, b's in bits 0..3.
uint32_t cvt_rn_satfinite_e2m1x2_f32(float a, float b);

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

}  // namespace csa2_simt

#define threadIdx (::csa2_simt::self().thread_idx)
#define blockIdx (::csa2_simt::self().block_idx)
#define blockDim (::csa2_simt::self().block_dim)
#define gridDim (::csa2_simt::self().grid_dim)

inline void __syncthreads() { ::csa2_simt::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::csa2_simt::sync_warp(mask); }

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    using namespace csa2_simt;
    return from_bits<T>(shfl(mask, to_bits(v), ShflMode::Idx, src, width));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    using namespace csa2_simt;
    return from_bits<T>(shfl(mask, to_bits(v), ShflMode::Xor, lane_mask, width));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    using namespace csa2_simt;
    return from_bits<T>(shfl(mask, to_bits(v), ShflMode::Up, (int)delta, width));
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    using namespace csa2_simt;
    return from_bits<T>(shfl(mask, to_bits(v), ShflMode::Down, (int)delta, width));
}

// Atomics through the compiler's atomic builtins (sequentially consistent; ThreadSanitizer sees them).
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int atomicCAS(int* p, int expected, int desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;  // the old value, whether or not the exchange happened
}
inline unsigned atomicCAS(unsigned* p, unsigned expected, unsigned desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}

inline float __int_as_float(int v) { return ::csa2_simt::from_bits<float>((uint32_t)v); }
inline float __uint_as_float(unsigned v) { return ::csa2_simt::from_bits<float>(v); }
inline unsigned __float_as_uint(float v) { return (unsigned)::csa2_simt::to_bits(v); }
inline int __float_as_int(float v) { return (int)(unsigned)::csa2_simt::to_bits(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline float __fdiv_rn(float a, float b) { return a / b; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
