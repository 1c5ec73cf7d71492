// The host SIMT harness's scheduler and launch entry (see simt.h). Linked into every host-compiled
// kernel module; src/cuda/emu.rs calls `csa2_simt_launch` through dlsym.
//
// Model: one fiber (its own stack, switched by csa2_simt_switch below) per CUDA thread. A block's fibers run on the calling OS thread, in
// thread order, each until it waits (at __syncthreads, a warp barrier, a shuffle or an mma) or
// returns; a barrier opens when every thread of its group that has not returned has arrived, and a
// returned thread drops out of its block's and warp's barriers. When no fiber can run and some
// have not returned, the block is deadlocked (a divergent barrier) and the launch fails with a
// message naming where each thread waits. Blocks run one after another; shared memory is one
// section per module, set to 0xFF before every block, so a read of a shared word no thread wrote
// in this block shows as NaN / all-ones.
//
// Under ThreadSanitizer the fibers are announced (__tsan_create_fiber) and switched without
// implied synchronisation; barriers, shuffles and mma release on arrival and acquire on leaving,
// so a missing __syncthreads is a reported race. Under AddressSanitizer stack switches are
// announced (__sanitizer_start/finish_switch_fiber).
#include "simt.h"
#include "registry.h"

#include <sys/mman.h>

#include <cstdarg>
#include <deque>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

// build.rs defines CSA2_SIMT_TSAN for the ThreadSanitizer build of a module and compiles this file
// without instrumentation there: the scheduler's own bookkeeping is shared by every fiber of a
// block, and ordering it through TSan would order the fibers' kernel accesses too, hiding the
// races the build exists to find. The kernel's accesses are instrumented; the fiber switches and
// the barrier edges below are announced explicitly.
#if defined(CSA2_SIMT_TSAN)
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#endif
#if defined(CSA2_SIMT_ASAN)
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, size_t* size_old);
void __asan_unpoison_memory_region(void const volatile* addr, size_t size);
}
#endif


// A context switch without a system call (ucontext's swapcontext saves the signal mask, two
// syscalls a switch, which dominated the harness's time): saves the callee-saved registers, MXCSR
// and the x87 control word on the current stack, stores the stack pointer in *save, loads `to`.
extern "C" void csa2_simt_switch(void** save, void* to);
#if defined(__x86_64__)
asm(R"(
    .text
    .globl csa2_simt_switch
    .hidden csa2_simt_switch
    .type csa2_simt_switch,@function
csa2_simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size csa2_simt_switch, .-csa2_simt_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#else
#error "the host SIMT harness's context switch is written for x86-64"
#endif

namespace csa2_simt {
namespace {
void fiber_main();

// A stack laid out as csa2_simt_switch leaves one: the saved control words and six registers,
// then fiber_main as the return address (entered with the stack 16-byte aligned as after a call).
void* fresh_stack(char* base, size_t size) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(base) + size) & ~uintptr_t{15};
#ifdef CSA2_SIMT_ASAN
    // A finished fiber never returns from fiber_main, so the redzones AddressSanitizer poisoned in
    // its top frames stay poisoned; the words written below would hit them (how deep those
    // redzones sit depends on the compiler's inlining). Instrumented frames set their own shadow
    // on entry, so only this layout needs clearing.
    __asan_unpoison_memory_region(reinterpret_cast<void*>(top - 256), 256);
#endif
    uint64_t* p = reinterpret_cast<uint64_t*>(top);
    *--p = 0;  // fiber_main's own return address: none (it never returns)
    *--p = reinterpret_cast<uint64_t>(&fiber_main);
    for (int i = 0; i < 6; i++) *--p = 0;  // rbp rbx r12 r13 r14 r15
    uint32_t mxcsr;
    uint16_t fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    *--p = (uint64_t)mxcsr | ((uint64_t)fpucw << 32);
    return p;
}
}  // namespace
}  // namespace csa2_simt

extern "C" char __start_csa2_simt_shared[] __attribute__((weak));
extern "C" char __stop_csa2_simt_shared[] __attribute__((weak));

namespace csa2_simt {

namespace {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
#if defined(CSA2_SIMT_TSAN) || defined(CSA2_SIMT_ASAN)
constexpr size_t kStack = 512 * 1024;
#else
constexpr size_t kStack = 128 * 1024;
#endif

enum class State { Ready, Waiting, Done };
enum class Wait { None, Block, Warp };

// One queued cp.async of a thread.
struct AsyncCopy {
    void* dst;
    const void* src;
    unsigned bytes;
};

struct Fiber {
    void* sp = nullptr;  // saved stack pointer while switched out
    std::vector<AsyncCopy> open_copies;             // issued, not yet committed
    std::deque<std::vector<AsyncCopy>> groups;      // committed, not yet waited for (oldest first)
    char* stack = nullptr;
    ThreadState ts;
    int linear = 0;
    State state = State::Ready;
    Wait wait = Wait::None;
    const char* wait_what = "";
    bool started = false;
#ifdef CSA2_SIMT_TSAN
    void* tsan = nullptr;
#endif
};

struct Barrier {
    int live = 0;
    int arrived = 0;
};

struct WarpState {
    Barrier bar;
    bool exited[kWarp];
    uint64_t slot[kWarp];
    uint32_t mma[kWarp][10];
};

// One launch in flight on this OS thread.
struct Run {
    const KernelEntry* entry = nullptr;
    void** args = nullptr;
    int n = 0;
    std::vector<Fiber>* fibers = nullptr;
    Barrier block;
    std::vector<WarpState> warps;
    void* sched_sp = nullptr;
    Fiber* cur = nullptr;
    std::string error;
    bool failed = false;
#ifdef CSA2_SIMT_TSAN
    void* sched_tsan = nullptr;
#endif
#ifdef CSA2_SIMT_ASAN
    const void* sched_stack_bottom = nullptr;
    size_t sched_stack_size = 0;
#endif
};

thread_local Run* g_run = nullptr;
// The module's fibers, grown to the largest block launched so far. One set per module: launches
// of a module are serialised (g_launch_lock), so a fiber (and, under ThreadSanitizer, its
// registration, of which the runtime allows a few thousand per process) is never made twice.
std::vector<Fiber>* g_pool = nullptr;

std::vector<Fiber>& pool(int n) {
    if (!g_pool) g_pool = new std::vector<Fiber>();
    g_pool->reserve(kMaxThreads);  // never reallocated: a running launch holds pointers into it
    while ((int)g_pool->size() < n) {
        Fiber f;
        void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            std::fprintf(stderr, "csa2 SIMT harness: cannot map a fiber stack\n");
            std::abort();
        }
        f.stack = static_cast<char*>(p);
#ifdef CSA2_SIMT_TSAN
        f.tsan = __tsan_create_fiber(0);
#endif
        g_pool->push_back(f);
    }
    return *g_pool;
}

// Switches from the running context to `to`; `from` is saved. `sync`: whether ThreadSanitizer
// should see an ordering edge across the switch.
void switch_to(void** from, void* to, const char* to_stack, size_t to_size,
#ifdef CSA2_SIMT_TSAN
               void* to_tsan,
#endif
               bool sync, bool dying = false) {
#ifdef CSA2_SIMT_TSAN
    __tsan_switch_to_fiber(to_tsan, sync ? 0u : 1u /* __tsan_switch_to_fiber_no_sync */);
#else
    (void)sync;
#endif
#ifdef CSA2_SIMT_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(dying ? nullptr : &fake, to_stack, to_size);
    csa2_simt_switch(from, to);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    (void)to_stack;
    (void)to_size;
    (void)dying;
    csa2_simt_switch(from, to);
#endif
}

void to_scheduler(bool sync, bool dying = false) {
    Run& r = *g_run;
    Fiber* f = r.cur;
#ifdef CSA2_SIMT_ASAN
    switch_to(&f->sp, r.sched_sp, static_cast<const char*>(r.sched_stack_bottom), r.sched_stack_size,
#else
    switch_to(&f->sp, r.sched_sp, nullptr, 0,
#endif
#ifdef CSA2_SIMT_TSAN
              r.sched_tsan,
#endif
              sync, dying);
}

[[noreturn]] void fail(const char* fmt, ...) {
    Run& r = *g_run;
    if (!r.failed) {
        char buf[512];
        va_list ap;
        va_start(ap, fmt);
        std::vsnprintf(buf, sizeof buf, fmt, ap);
        va_end(ap);
        const ThreadState& t = r.cur->ts;
        char where[160];
        std::snprintf(where, sizeof where, " (block (%u,%u,%u), thread (%u,%u,%u))", t.block_idx.x, t.block_idx.y,
                      t.block_idx.z, t.thread_idx.x, t.thread_idx.y, t.thread_idx.z);
        r.error = std::string(buf) + where;
        r.failed = true;
    }
    r.cur->state = State::Done;
    to_scheduler(true, true);
    std::abort();  // never resumed
}

void release(Barrier& b, Wait kind, int warp) {
    b.arrived = 0;
    std::vector<Fiber>& fs = *g_run->fibers;
    int lo = kind == Wait::Block ? 0 : warp * kWarp;
    int hi = kind == Wait::Block ? g_run->n : std::min(g_run->n, lo + kWarp);
    for (int i = lo; i < hi; i++) {
        Fiber& f = fs[i];
        if (f.state == State::Waiting && f.wait == kind) {
            f.state = State::Ready;
            f.wait = Wait::None;
        }
    }
}

void wait_at(Barrier& b, Wait kind, const char* what) {
    Run& r = *g_run;
    Fiber* f = r.cur;
    int warp = f->linear / kWarp;
#ifdef CSA2_SIMT_TSAN
    __tsan_release(&b);
#endif
    if (++b.arrived == b.live) {
        release(b, kind, warp);
    } else {
        f->state = State::Waiting;
        f->wait = kind;
        f->wait_what = what;
        to_scheduler(false);
        if (r.failed) fail("aborted");
    }
#ifdef CSA2_SIMT_TSAN
    __tsan_acquire(&b);
#endif
}

WarpState& my_warp() { return g_run->warps[g_run->cur->linear / kWarp]; }
int my_lane() { return g_run->cur->linear % kWarp; }

void need_full_mask(unsigned mask, const char* what) {
    if (mask != 0xffffffffu) fail("%s with mask 0x%08x: the harness models full-warp masks only", what, mask);
}

}  // namespace

const ThreadState& self() { return g_run->cur->ts; }

void sync_block() {
    Run& r = *g_run;
    wait_at(r.block, Wait::Block, "__syncthreads");
}

void sync_warp(unsigned mask) {
    need_full_mask(mask, "__syncwarp");
    wait_at(my_warp().bar, Wait::Warp, "__syncwarp");
}

uint64_t shfl(unsigned mask, uint64_t bits, ShflMode mode, int arg, int width) {
    need_full_mask(mask, "a shuffle");
    if (width < 1 || width > kWarp || (width & (width - 1)) != 0) fail("a shuffle of width %d", width);
    WarpState& w = my_warp();
    int lane = my_lane();
    w.slot[lane] = bits;
    wait_at(w.bar, Wait::Warp, "a shuffle");
    int base = lane & ~(width - 1);
    int src = lane;
    switch (mode) {
        case ShflMode::Idx: src = base + (arg & (width - 1)); break;
        case ShflMode::Xor: src = lane ^ arg; if (src >= base + width || src < 0 || src >= kWarp) src = lane; break;
        case ShflMode::Up: src = lane - arg; if (src < base) src = lane; break;
        case ShflMode::Down: src = lane + arg; if (src >= base + width) src = lane; break;
    }
    // A lane that has returned supplies all-ones bits (NaN as a float), which a used result shows.
    uint64_t v = w.exited[src] ? ~uint64_t{0} : w.slot[src];
    wait_at(w.bar, Wait::Warp, "a shuffle");
    return v;
}

void cp_async(void* dst, const void* src, unsigned bytes) {
    if (bytes != 4 && bytes != 8 && bytes != 16) fail("cp.async of %u bytes (4, 8 or 16 only)", bytes);
    if (((uintptr_t)dst | (uintptr_t)src) % bytes != 0)
        fail("cp.async of %u bytes with a misaligned address (dst %p, src %p)", bytes, dst, src);
    std::memset(dst, 0xff, bytes);
    g_run->cur->open_copies.push_back(AsyncCopy{dst, src, bytes});
}

void cp_async_commit() {
    Fiber* f = g_run->cur;
    f->groups.push_back(std::move(f->open_copies));
    f->open_copies.clear();
}

void cp_async_wait(int n) {
    Fiber* f = g_run->cur;
    if (n < 0) fail("cp.async.wait_group %d", n);
    while ((int)f->groups.size() > n) {
        for (const AsyncCopy& c : f->groups.front()) std::memcpy(c.dst, c.src, c.bytes);
        f->groups.pop_front();
    }
}

namespace {

float bf16_lo(uint32_t v) { return from_bits<float>((uint64_t)((v & 0xffffu) << 16)); }
float bf16_hi(uint32_t v) { return from_bits<float>((uint64_t)(v & 0xffff0000u)); }
float bf16_half(uint32_t v, int half) { return half ? bf16_hi(v) : bf16_lo(v); }

}  // namespace

void mma_m16n8k16_bf16_f32(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                           uint32_t b1) {
    WarpState& w = my_warp();
    for (int l = 0; l < kWarp; l++)
        if (w.exited[l]) fail("mma.sync with lane %d of the warp returned", l);
    int lane = my_lane();
    uint32_t* s = w.mma[lane];
    s[0] = a0, s[1] = a1, s[2] = a2, s[3] = a3, s[4] = b0, s[5] = b1;
    wait_at(w.bar, Wait::Warp, "mma.sync");
    // The PTX ISA's fragment layout for m16n8k16 with .bf16 A (row) and B (col):
    //   A element (row r, col k): lane 4·(r mod 8) + (k mod 8) / 2, register a[(r ≥ 8) + 2·(k ≥ 8)],
    //     half-word (k mod 2) (the lower half holds the lower column);
    //   B element (row k, col n): lane 4·n + (k mod 8) / 2, register b[k ≥ 8], half-word (k mod 2);
    //   C/D element (row r, col n): lane 4·(r mod 8) + n / 2, register c[2·(r ≥ 8) + (n mod 2)].
    auto A = [&](int r, int k) {
        int l = 4 * (r % 8) + (k % 8) / 2;
        return (double)bf16_half(w.mma[l][(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2);
    };
    auto B = [&](int k, int n) {
        int l = 4 * n + (k % 8) / 2;
        return (double)bf16_half(w.mma[l][4 + (k >= 8 ? 1 : 0)], k % 2);
    };
    float out[4];
    for (int i = 0; i < 4; i++) {
        int r = lane / 4 + (i >= 2 ? 8 : 0);
        int n = 2 * (lane % 4) + (i % 2);
        double acc = 0.0;
        for (int k = 0; k < 16; k++) acc += A(r, k) * B(k, n);
        out[i] = (float)((double)c[i] + acc);
    }
    wait_at(w.bar, Wait::Warp, "mma.sync");
    for (int i = 0; i < 4; i++) c[i] = out[i];
}

namespace {

// E2M1 with round-to-nearest-even over the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating to
// 6; the sign bit follows the input's sign; NaN saturates.
uint32_t e2m1_rn_satfinite(float x) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    uint32_t sign = std::signbit(x) ? 8u : 0u;
    if (std::isnan(x)) return 7u;
    float a = std::fabs(x);
    if (a >= 6.0f) return sign | 7u;
    uint32_t best = 0;
    for (uint32_t c = 1; c < 8; c++) {
        float d = std::fabs(a - mag[c]), db = std::fabs(a - mag[best]);
        if (d < db || (d == db && (c & 1u) == 0 && (best & 1u) == 1)) best = c;
    }
    return sign | best;
}

}  // namespace

uint32_t cvt_rn_satfinite_e2m1x2_f32(float a, float b) {
    return (e2m1_rn_satfinite(a) << 4) | e2m1_rn_satfinite(b);
}

// ---- launch ----------------------------------------------------------------------------------------

namespace {

void fiber_main() {
    Run& r = *g_run;
    Fiber* f = r.cur;
#ifdef CSA2_SIMT_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &r.sched_stack_bottom, &r.sched_stack_size);
#endif
    r.entry->invoke(r.args);
    // Returned: drop out of the block's and the warp's barriers (opening them if this thread was
    // the last one they waited for).
    int warp = f->linear / kWarp;
    WarpState& w = r.warps[warp];
    w.exited[f->linear % kWarp] = true;
    r.block.live--;
    if (r.block.arrived > 0 && r.block.arrived == r.block.live) release(r.block, Wait::Block, warp);
    w.bar.live--;
    if (w.bar.arrived > 0 && w.bar.arrived == w.bar.live) release(w.bar, Wait::Warp, warp);
    f->state = State::Done;
    to_scheduler(true, true);
}

int g_schedule_reverse = 0;

bool run_block(Run& r, Dim3 grid, Dim3 block, Dim3 bidx) {
    size_t shared = (size_t)(__stop_csa2_simt_shared - __start_csa2_simt_shared);
    if (shared) std::memset(__start_csa2_simt_shared, 0xff, shared);
    std::vector<Fiber>& fs = *r.fibers;
    r.block = Barrier{r.n, 0};
    int nwarps = (r.n + kWarp - 1) / kWarp;
    r.warps.assign(nwarps, WarpState{});
    for (int w = 0; w < nwarps; w++) {
        int lanes = r.n - w * kWarp < kWarp ? r.n - w * kWarp : kWarp;
        r.warps[w].bar = Barrier{lanes, 0};
        for (int l = 0; l < kWarp; l++) r.warps[w].exited[l] = l >= lanes;
    }
    for (int i = 0; i < r.n; i++) {
        Fiber& f = fs[i];
        f.linear = i;
        f.state = State::Ready;
        f.wait = Wait::None;
        f.started = false;
        f.open_copies.clear();
        f.groups.clear();
        f.ts.thread_idx = Dim3{(unsigned)i % block.x, (unsigned)(i / block.x) % block.y, (unsigned)(i / (block.x * block.y))};
        f.ts.block_idx = bidx;
        f.ts.block_dim = block;
        f.ts.grid_dim = grid;
        f.sp = fresh_stack(f.stack, kStack);
    }
    int done = 0;
    while (done < r.n && !r.failed) {
        bool ran = false;
        for (int k = 0; k < r.n && !r.failed; k++) {
            int i = g_schedule_reverse ? r.n - 1 - k : k;
            Fiber& f = fs[i];
            if (f.state != State::Ready) continue;
            ran = true;
            r.cur = &f;
            bool first = !f.started;
            f.started = true;
            switch_to(&r.sched_sp, f.sp, f.stack, kStack,
#ifdef CSA2_SIMT_TSAN
                      f.tsan,
#endif
                      first);
            r.cur = nullptr;
            if (f.state == State::Done) done++;
        }
        if (!ran && !r.failed) {
            // Deadlock: say where the first waiting threads of each kind are.
            std::string where;
            int shown = 0;
            for (int i = 0; i < r.n && shown < 6; i++) {
                if (fs[i].state != State::Waiting) continue;
                char buf[96];
                std::snprintf(buf, sizeof buf, "%sthread %d at %s", shown ? ", " : "", i, fs[i].wait_what);
                where += buf;
                shown++;
            }
            char buf[160];
            std::snprintf(buf, sizeof buf,
                          "divergent barrier in block (%u,%u,%u): %d of %d threads wait and none can go on (",
                          bidx.x, bidx.y, bidx.z, r.n - done, r.n);
            r.error = buf + where + ")";
            r.failed = true;
        }
    }
    return !r.failed;
}

std::mutex g_launch_lock;

}  // namespace
}  // namespace csa2_simt

extern "C" {

// Kernel names of this module, null-terminated.
__attribute__((visibility("default"))) const char* const* csa2_simt_kernel_names() {
    static std::vector<const char*> names = [] {
        std::vector<const char*> v;
        for (size_t i = 0; i < csa2_simt::kernel_count(); i++) v.push_back(csa2_simt::kernel_at(i).name);
        v.push_back(nullptr);
        return v;
    }();
    return names.data();
}

// 0 = thread order (default), 1 = reverse thread order: which fiber of a block runs first.
__attribute__((visibility("default"))) void csa2_simt_set_schedule(int reverse) {
    csa2_simt::g_schedule_reverse = reverse;
}

// Runs kernel `name` over `grid` × `block` with `args` (CUDA's kernelParams: one pointer per
// parameter) whose sizes are `sizes`. Returns 0, or 1 with a message in `msg`. Checks, as a GPU
// launch would: the kernel exists, the argument count and each argument's size match its
// signature, the block has 1..1024 threads (and no more than the kernel's __launch_bounds__),
// blockDim.z ≤ 64, gridDim.x < 2^31, gridDim.y, gridDim.z ≤ 65,535, no dynamic shared memory.
__attribute__((visibility("default"))) int csa2_simt_launch(const char* name, const unsigned* grid3,
                                                           const unsigned* block3, unsigned dynamic_shared,
                                                           void** args, const size_t* sizes, int nargs,
                                                           char* msg, size_t msg_len) {
    using namespace csa2_simt;
    auto err = [&](const std::string& s) {
        if (msg_len) {
            std::snprintf(msg, msg_len, "%s", s.c_str());
        }
        return 1;
    };
    const KernelEntry* e = nullptr;
    for (size_t i = 0; i < kernel_count(); i++)
        if (std::strcmp(kernel_at(i).name, name) == 0) e = &kernel_at(i);
    if (!e) return err(std::string("no kernel named `") + name + "` in this module");
    if (nargs != (int)e->nparams)
        return err(std::string(name) + ": " + std::to_string(nargs) + " arguments pushed, the kernel takes " +
                   std::to_string(e->nparams));
    for (int i = 0; i < nargs; i++)
        if (sizes[i] != e->sizes[i])
            return err(std::string(name) + ": argument " + std::to_string(i) + " is " + std::to_string(sizes[i]) +
                       " bytes, the kernel's parameter is " + std::to_string(e->sizes[i]));
    Dim3 grid{grid3[0], grid3[1], grid3[2]}, block{block3[0], block3[1], block3[2]};
    unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (threads == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0) return err(std::string(name) + ": an empty grid or block");
    if (threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64)
        return err(std::string(name) + ": block (" + std::to_string(block.x) + "," + std::to_string(block.y) + "," +
                   std::to_string(block.z) + ") exceeds the device's 1024 threads per block");
    if (e->max_threads && threads > e->max_threads)
        return err(std::string(name) + ": " + std::to_string(threads) + " threads per block, its __launch_bounds__ allow " +
                   std::to_string(e->max_threads));
    if (grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
        return err(std::string(name) + ": grid (" + std::to_string(grid.x) + "," + std::to_string(grid.y) + "," +
                   std::to_string(grid.z) + ") exceeds the device's limits (2^31-1, 65535, 65535)");
    if (dynamic_shared) return err(std::string(name) + ": dynamic shared memory is not used by csa2 kernels");

    std::lock_guard<std::mutex> lock(g_launch_lock);
    Run r;
    r.entry = e;
    r.args = args;
    r.n = (int)threads;
    r.fibers = &pool(r.n);
#ifdef CSA2_SIMT_TSAN
    r.sched_tsan = __tsan_get_current_fiber();
#endif
    Run* outer = g_run;
    g_run = &r;
    bool ok = true;
    for (unsigned z = 0; z < grid.z && ok; z++)
        for (unsigned y = 0; y < grid.y && ok; y++)
            for (unsigned x = 0; x < grid.x && ok; x++) ok = run_block(r, grid, block, Dim3{x, y, z});
    g_run = outer;
    if (!ok) return err(std::string(name) + ": " + r.error);
    return 0;
}
}
