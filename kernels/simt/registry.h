// The kernel table of one host-compiled module: each `extern "C" __global__` with a trampoline
// that unpacks CUDA-style kernel parameters (one pointer per parameter) and the size of each
// parameter, so a launch with a wrong argument count or size is refused instead of run.
#pragma once

#include <cstddef>
#include <cstring>
#include <utility>

namespace csa2_simt {

constexpr size_t kMaxParams = 32;

struct KernelEntry {
    const char* name;
    void (*invoke)(void** args);
    size_t nparams;
    size_t sizes[kMaxParams];
    unsigned max_threads;  // the kernel's __launch_bounds__ (0: none)
};

size_t kernel_count();
const KernelEntry& kernel_at(size_t i);

template <class T>
T load_param(void* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}

template <auto F, class... A, size_t... I>
void invoke_with(void (*)(A...), void** args, std::index_sequence<I...>) {
    F(load_param<A>(args[I])...);
}

template <auto F>
void invoke(void** args) {
    invoke_with<F>(F, args, std::make_index_sequence<[]<class... A>(void (*)(A...)) { return sizeof...(A); }(F)>{});
}

template <class... A>
constexpr KernelEntry make_entry(const char* name, void (*)(A...), void (*inv)(void**), unsigned max_threads) {
    static_assert(sizeof...(A) <= kMaxParams, "too many kernel parameters for the harness");
    KernelEntry e{name, inv, sizeof...(A), {sizeof(A)...}, max_threads};
    return e;
}

}  // namespace csa2_simt

// One table row: CSA2_SIMT_KERNEL(name, launch_bound or 0).
#define CSA2_SIMT_KERNEL(fn, bound) ::csa2_simt::make_entry(#fn, &fn, &::csa2_simt::invoke<&fn>, (unsigned)(bound))

#define CSA2_SIMT_TABLE(...)                                                                         \
    namespace csa2_simt {                                                                            \
    static const KernelEntry g_table[] = {__VA_ARGS__};                                              \
    size_t kernel_count() { return sizeof g_table / sizeof g_table[0]; }                             \
    const KernelEntry& kernel_at(size_t i) { return g_table[i]; }                                    \
    }
