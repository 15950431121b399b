// seqdist CUDA emulator: runs the CUDA subset used by seqdist's kernels on the CPU.
// Written by nbs/01_utils.ipynb; see the notebook for the design. Force-included (g++ -include)
// before a kernel source; the launch glue is generated per kernel by seqdist.utils.
#pragma once
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdarg>
#include <cstdlib>
#include <cassert>
#include <string>
#include <vector>
#include <utility>
#include <type_traits>
#include <ucontext.h>
#include <signal.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <unistd.h>

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };

namespace emu {

enum class St { runnable, barrier, warp, done };
enum class Op { syncwarp, shfl, shfl_up, shfl_down, shfl_xor, ballot, any, all };
inline const char* op_name(Op op) {
    static const char* names[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                  "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync"};
    return names[(int)op];
}

struct Thread {
    ucontext_t ctx;
    uint3 idx;
    int linear, lane, warp;
    St state;
    int line;                     // source line of the barrier or warp operation it waits at
    Op op; unsigned mask; int arg, width; uint64_t value, result;
    char* stack;
};

struct LaunchCfg { unsigned grid[3]; unsigned block[3]; unsigned long long shared_mem, seed; };

// One kernel runs at a time (the Python side holds a lock), so the state is global.
inline Thread* g_cur = nullptr;
inline std::vector<Thread> g_threads;
inline std::vector<char*> g_stacks;
inline ucontext_t g_sched;
inline uint3 g_blockIdx;
inline dim3 g_blockDim, g_gridDim;
inline char* g_dyn_smem = nullptr;
inline std::string g_error;
inline bool g_failed = false;
inline void (*g_body)(void*) = nullptr;
inline void* g_body_arg = nullptr;
inline sigjmp_buf g_fault_jmp;
inline volatile uintptr_t g_fault_addr = 0;
inline const size_t STACK_BYTES = 256 * 1024;

inline std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* f, ...) {
    char buf[1024]; va_list ap; va_start(ap, f); vsnprintf(buf, sizeof buf, f, ap); va_end(ap);
    return buf;
}
inline std::string where(const Thread& t) {
    return fmt("thread (%u,%u,%u) of block (%u,%u,%u)", t.idx.x, t.idx.y, t.idx.z,
               g_blockIdx.x, g_blockIdx.y, g_blockIdx.z);
}
inline void yield() { swapcontext(&g_cur->ctx, &g_sched); }

// An error found by a running thread: record it and never resume that thread.
[[noreturn]] inline void fail(const std::string& msg) {
    if (!g_failed) { g_failed = true; g_error = msg; }
    g_cur->state = St::done;
    swapcontext(&g_cur->ctx, &g_sched);
    abort();  // unreachable: a failed block is abandoned
}

inline void syncthreads(int line) { g_cur->state = St::barrier; g_cur->line = line; yield(); }

template <class T>
inline uint64_t bits(T v) { static_assert(sizeof(T) <= 8, "warp operations take values of at most 8 bytes");
                            uint64_t b = 0; memcpy(&b, &v, sizeof(T)); return b; }
template <class T>
inline T from_bits(uint64_t b) { T v; memcpy(&v, &b, sizeof(T)); return v; }

inline uint64_t warp_op(Op op, int line, unsigned mask, uint64_t value, int arg, int width) {
    Thread* t = g_cur;
    if (!((mask >> t->lane) & 1u))
        fail(fmt("%s (line %d): %s calls it with mask 0x%08x, which does not include its own lane %d",
                 op_name(op), line, where(*t).c_str(), mask, t->lane));
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail(fmt("%s (line %d): width %d is not a power of two in [1, 32]", op_name(op), line, width));
    t->op = op; t->line = line; t->mask = mask; t->value = value; t->arg = arg; t->width = width;
    t->state = St::warp;
    yield();
    return t->result;
}

inline void syncwarp(int line, unsigned mask = 0xffffffffu) { warp_op(Op::syncwarp, line, mask, 0, 0, 32); }
template <class T> inline T shfl_sync(int line, unsigned mask, T v, int src, int width = 32) {
    return from_bits<T>(warp_op(Op::shfl, line, mask, bits(v), src, width)); }
template <class T> inline T shfl_up_sync(int line, unsigned mask, T v, unsigned d, int width = 32) {
    return from_bits<T>(warp_op(Op::shfl_up, line, mask, bits(v), (int)d, width)); }
template <class T> inline T shfl_down_sync(int line, unsigned mask, T v, unsigned d, int width = 32) {
    return from_bits<T>(warp_op(Op::shfl_down, line, mask, bits(v), (int)d, width)); }
template <class T> inline T shfl_xor_sync(int line, unsigned mask, T v, int m, int width = 32) {
    return from_bits<T>(warp_op(Op::shfl_xor, line, mask, bits(v), m, width)); }
inline unsigned ballot_sync(int line, unsigned mask, int p) { return (unsigned)warp_op(Op::ballot, line, mask, p != 0, 0, 32); }
inline int any_sync(int line, unsigned mask, int p) { return (int)warp_op(Op::any, line, mask, p != 0, 0, 32); }
inline int all_sync(int line, unsigned mask, int p) { return (int)warp_op(Op::all, line, mask, p != 0, 0, 32); }

// The lane whose value `lane` receives, following the CUDA programming guide's rules for width.
inline int source_lane(Op op, int lane, int arg, int width) {
    int base = lane & ~(width - 1), pos = lane & (width - 1);
    switch (op) {
        case Op::shfl: return base + (arg & (width - 1));
        case Op::shfl_up: return pos >= arg ? lane - arg : lane;
        case Op::shfl_down: return pos + arg < width ? lane + arg : lane;
        case Op::shfl_xor: { int s = lane ^ arg; return s >= base + width ? lane : s; }
        default: return lane;
    }
}

// Complete the warp operation that `t` waits at, if every lane named by its mask has arrived at one
// with the same mask. Returns 1 if completed, 0 if it must wait, and sets `why` if it never can.
inline int try_complete_warp_op(Thread& t, int nthreads, std::string& why) {
    int first = t.warp * 32, nlanes = std::min(32, nthreads - first);
    unsigned part = t.mask & (nlanes == 32 ? 0xffffffffu : ((1u << nlanes) - 1));
    for (int l = 0; l < nlanes; l++) {
        if (!((part >> l) & 1u)) continue;
        Thread& o = g_threads[first + l];
        if (o.state == St::done) {
            why = fmt("%s (line %d, mask 0x%08x): %s exited without taking part", op_name(t.op), t.line, t.mask,
                      where(o).c_str()); return 0; }
        if (o.state == St::barrier) {
            why = fmt("%s (line %d, mask 0x%08x) waits for %s, which waits at __syncthreads() (line %d)",
                      op_name(t.op), t.line, t.mask, where(o).c_str(), o.line); return 0; }
        if (o.state != St::warp) return 0;
        if (o.mask != t.mask || o.op != t.op) {
            why = fmt("warp divergence: %s waits at %s (line %d, mask 0x%08x) but %s at %s (line %d, mask 0x%08x)",
                      where(t).c_str(), op_name(t.op), t.line, t.mask, where(o).c_str(), op_name(o.op), o.line, o.mask);
            return 0; }
    }
    unsigned votes = 0;
    for (int l = 0; l < nlanes; l++)
        if ((part >> l) & 1u && g_threads[first + l].value) votes |= 1u << l;
    for (int l = 0; l < nlanes; l++) {
        if (!((part >> l) & 1u)) continue;
        Thread& o = g_threads[first + l];
        switch (o.op) {
            case Op::syncwarp: o.result = 0; break;
            case Op::ballot: o.result = votes; break;
            case Op::any: o.result = votes != 0; break;
            case Op::all: o.result = votes == part; break;
            default: {
                int s = source_lane(o.op, l, o.arg, o.width);
                if (s < 0 || s >= nlanes || !((part >> s) & 1u)) {
                    why = fmt("%s (line %d): %s reads lane %d, which is not a live lane named in mask 0x%08x",
                              op_name(o.op), o.line, where(o).c_str(), s, o.mask);
                    return 0; }
                o.result = g_threads[first + s].value;
            }
        }
    }
    for (int l = 0; l < nlanes; l++)
        if ((part >> l) & 1u) g_threads[first + l].state = St::runnable;
    return 1;
}
inline void trampoline() {
    g_body(g_body_arg);
    g_cur->state = St::done;
    swapcontext(&g_cur->ctx, &g_sched);
}

struct Rng {  // xorshift64*: a seeded order for blocks and threads
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull) { if (!s) s = 1; }
    uint64_t next() { s ^= s >> 12; s ^= s << 25; s ^= s >> 27; return s * 0x2545F4914F6CDD1Dull; }
    template <class V> void shuffle(V& v) { for (size_t i = v.size(); i > 1; i--) std::swap(v[i - 1], v[next() % i]); }
};

// Run one block to completion: threads are fibers that run, in a shuffled order, until each waits at a
// barrier or a warp operation (or exits); then the waits that can complete are completed.
inline bool run_block(int nthreads, Rng& rng) {
    std::vector<int> order;
    for (;;) {
        order.clear();
        for (int i = 0; i < nthreads; i++) if (g_threads[i].state == St::runnable) order.push_back(i);
        rng.shuffle(order);
        for (int i : order) {
            g_cur = &g_threads[i];
            swapcontext(&g_sched, &g_cur->ctx);
            if (g_failed) return false;
        }
        // Complete the warp operations that can complete.
        std::string why; bool progress = false;
        for (int i = 0; i < nthreads; i++)
            if (g_threads[i].state == St::warp) progress |= try_complete_warp_op(g_threads[i], nthreads, why) == 1;
        if (progress) continue;
        int done = 0, at_barrier = 0, at_warp = 0;
        for (int i = 0; i < nthreads; i++) {
            St s = g_threads[i].state;
            done += s == St::done; at_barrier += s == St::barrier; at_warp += s == St::warp;
        }
        if (done == nthreads) return true;
        if (at_warp) {
            if (why.empty()) {
                for (int i = 0; i < nthreads; i++) if (g_threads[i].state == St::warp) {
                    why = fmt("deadlock: %s waits at %s (line %d) that cannot complete", where(g_threads[i]).c_str(),
                              op_name(g_threads[i].op), g_threads[i].line); break; }
            }
            g_error = why; return false;
        }
        // Everyone left waits at a barrier: all threads of the block must be at the same one.
        const Thread* a = nullptr;
        for (int i = 0; i < nthreads; i++) if (g_threads[i].state == St::barrier) { a = &g_threads[i]; break; }
        for (int i = 0; i < nthreads; i++) {
            const Thread& o = g_threads[i];
            if (o.state == St::done) {
                g_error = fmt("barrier divergence: %s waits at __syncthreads() (line %d) but %s has exited",
                              where(*a).c_str(), a->line, where(o).c_str());
                return false; }
            if (o.line != a->line) {
                g_error = fmt("barrier divergence: %s waits at __syncthreads() on line %d but %s on line %d",
                              where(*a).c_str(), a->line, where(o).c_str(), o.line);
                return false; }
        }
        for (int i = 0; i < nthreads; i++) g_threads[i].state = St::runnable;
    }
}

// `bytes` of memory that end where an inaccessible page begins (one more guards the start of the mapping).
inline char* guarded_alloc(size_t bytes, char*& base, size_t& mapped) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t body = (bytes + page - 1) / page * page;
    mapped = body + 2 * page;
    base = (char*)mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    mprotect(base, page, PROT_NONE);
    mprotect(base + page + body, page, PROT_NONE);
    return base + page + body - bytes;
}

inline void on_fault(int, siginfo_t* info, void*) {
    g_fault_addr = (uintptr_t)info->si_addr;
    siglongjmp(g_fault_jmp, 1);
}

inline int launch(const LaunchCfg* cfg, void (*body)(void*), void* arg) {
    g_error.clear(); g_failed = false; g_fault_addr = 0;
    g_body = body; g_body_arg = arg;
    g_gridDim = {cfg->grid[0], cfg->grid[1], cfg->grid[2]};
    g_blockDim = {cfg->block[0], cfg->block[1], cfg->block[2]};
    const int nthreads = (int)(cfg->block[0] * cfg->block[1] * cfg->block[2]);
    g_threads.assign(nthreads, Thread{});
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    while ((int)g_stacks.size() < nthreads) {  // reused across launches; a guard page below each stack
        char* s = (char*)mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (s == MAP_FAILED) { g_error = "emulator: cannot allocate thread stacks"; return 1; }
        mprotect(s, page, PROT_NONE);
        g_stacks.push_back(s + page);
    }
    size_t smem_bytes = (size_t)((cfg->shared_mem + 15) / 16 * 16), smem_mapped = 0;
    char* smem_base = nullptr;
    char* smem = guarded_alloc(smem_bytes, smem_base, smem_mapped);
    if (!smem) { g_error = "emulator: cannot allocate dynamic shared memory"; return 1; }
    g_dyn_smem = smem;

    // Faults (out-of-bounds accesses that reach a guard page, wild pointers) become errors, not crashes.
    static char altstack[64 * 1024];
    stack_t ss{}, old_ss{}; ss.ss_sp = altstack; ss.ss_size = sizeof altstack;
    struct sigaction sa{}, old_segv{}, old_bus{};
    sa.sa_sigaction = on_fault; sa.sa_flags = SA_SIGINFO | SA_ONSTACK; sigemptyset(&sa.sa_mask);
    sigaltstack(&ss, &old_ss);
    sigaction(SIGSEGV, &sa, &old_segv); sigaction(SIGBUS, &sa, &old_bus);
    int rc = 0;
    if (sigsetjmp(g_fault_jmp, 1)) {
        uintptr_t a = g_fault_addr;
        std::string who = g_cur ? where(*g_cur) : std::string("the emulator");
        uintptr_t s0 = (uintptr_t)smem, s1 = s0 + cfg->shared_mem;
        if (a >= (uintptr_t)smem_base && a < (uintptr_t)smem_base + smem_mapped)
            g_error = fmt("invalid access to dynamic shared memory by %s: address %p is %ld bytes %s the %llu bytes "
                          "requested by shared_mem", who.c_str(), (void*)a, a >= s1 ? (long)(a - s1) : (long)(s0 - a),
                          a >= s1 ? "past the end of" : "before", cfg->shared_mem);
        else
            g_error = fmt("invalid memory access by %s at address %p", who.c_str(), (void*)a);
        rc = 2;
    } else {
        std::vector<uint3> blocks;
        for (unsigned z = 0; z < cfg->grid[2]; z++)
            for (unsigned y = 0; y < cfg->grid[1]; y++)
                for (unsigned x = 0; x < cfg->grid[0]; x++) blocks.push_back({x, y, z});
        Rng rng(cfg->seed);
        rng.shuffle(blocks);  // blocks have no order on a GPU either
        for (const uint3& b : blocks) {
            g_blockIdx = b;
            memset(smem, 0xff, smem_bytes);  // shared memory starts as garbage (NaN for floats)
            for (int i = 0; i < nthreads; i++) {
                Thread& t = g_threads[i];
                t = Thread{};
                t.linear = i; t.lane = i % 32; t.warp = i / 32; t.state = St::runnable;
                t.idx = {(unsigned)i % cfg->block[0], (unsigned)(i / cfg->block[0]) % cfg->block[1],
                         (unsigned)(i / (cfg->block[0] * cfg->block[1]))};
                t.stack = g_stacks[i];
                getcontext(&t.ctx);
                t.ctx.uc_stack.ss_sp = t.stack; t.ctx.uc_stack.ss_size = STACK_BYTES; t.ctx.uc_link = nullptr;
                makecontext(&t.ctx, trampoline, 0);
            }
            if (!run_block(nthreads, rng)) { rc = 1; break; }
        }
    }
    sigaction(SIGSEGV, &old_segv, nullptr); sigaction(SIGBUS, &old_bus, nullptr);
    sigaltstack(&old_ss, nullptr);
    munmap(smem_base, smem_mapped);
    g_dyn_smem = nullptr; g_cur = nullptr;
    return rc;
}

// Kernel parameters arrive as an array of pointers to their values, as with cuLaunchKernel.
template <class... A, size_t... I>
inline void call_with(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_reference<A>::type*>(args[I])...);
}
template <class... A>
inline void call_kernel(void (*f)(A...), void** args) { call_with(f, args, std::index_sequence_for<A...>{}); }
// For the Python side to check its reading of the signature: size of each parameter, negated for pointers.
template <class... A>
inline int signature(void (*)(A...), int* sizes, int n) {
    int s[] = {0, (std::is_pointer<A>::value ? -(int)sizeof(A) : (int)sizeof(A))...};
    for (int i = 0; i < (int)sizeof...(A) && i < n; i++) sizes[i] = s[i + 1];
    return (int)sizeof...(A);
}

// `extern __shared__ T name[];` is rewritten to `static const emu::DynamicShared<T> name{};`
template <class T>
struct DynamicShared {
    operator T*() const { return reinterpret_cast<T*>(g_dyn_smem); }
    template <class U> explicit operator U*() const { return reinterpret_cast<U*>(g_dyn_smem); }  // (FLOAT*)smem
    template <class I> T& operator[](I i) const { return reinterpret_cast<T*>(g_dyn_smem)[i]; }
};

}  // namespace emu

extern "C" inline const char* __emu_last_error() { return emu::g_error.c_str(); }
extern "C" inline unsigned long long __emu_fault_address() { return emu::g_fault_addr; }
// ---- the CUDA names -------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __shared__ static
#define __forceinline__ __attribute__((always_inline)) inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define threadIdx (emu::g_cur->idx)
#define blockIdx (emu::g_blockIdx)
#define blockDim (emu::g_blockDim)
#define gridDim (emu::g_gridDim)
#define warpSize 32
#define __syncthreads() emu::syncthreads(__LINE__)
#define __syncwarp(...) emu::syncwarp(__LINE__, ##__VA_ARGS__)
#define __shfl_sync(...) emu::shfl_sync(__LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) emu::shfl_up_sync(__LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) emu::shfl_down_sync(__LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) emu::shfl_xor_sync(__LINE__, __VA_ARGS__)
#define __ballot_sync(m, p) emu::ballot_sync(__LINE__, m, p)
#define __any_sync(m, p) emu::any_sync(__LINE__, m, p)
#define __all_sync(m, p) emu::all_sync(__LINE__, m, p)
#define __threadfence() ((void)0)
#define __threadfence_block() ((void)0)
#undef assert
#define assert(c) ((c) ? (void)0 : emu::fail(emu::fmt("assertion failed: %s (line %d) in %s", #c, __LINE__, \
                                                          emu::where(*emu::g_cur).c_str())))

// Atomics: the fibers of a block never run at the same time, so a plain read-modify-write is atomic.
#define EMU_ATOMIC(NAME, T, EXPR) inline T NAME(T* a, T v) { T old = *a; *a = (EXPR); return old; }
#define EMU_ATOMIC_INT(NAME, EXPR) EMU_ATOMIC(NAME, int, EXPR) EMU_ATOMIC(NAME, unsigned int, EXPR) \
                                   EMU_ATOMIC(NAME, unsigned long long, EXPR)
EMU_ATOMIC_INT(atomicAdd, old + v) EMU_ATOMIC(atomicAdd, float, old + v) EMU_ATOMIC(atomicAdd, double, old + v)
EMU_ATOMIC(atomicSub, int, old - v) EMU_ATOMIC(atomicSub, unsigned int, old - v)
EMU_ATOMIC_INT(atomicExch, v) EMU_ATOMIC(atomicExch, float, v)
EMU_ATOMIC_INT(atomicMax, old > v ? old : v) EMU_ATOMIC(atomicMax, long long, old > v ? old : v)
EMU_ATOMIC_INT(atomicMin, old < v ? old : v) EMU_ATOMIC(atomicMin, long long, old < v ? old : v)
EMU_ATOMIC_INT(atomicAnd, old & v) EMU_ATOMIC_INT(atomicOr, old | v) EMU_ATOMIC_INT(atomicXor, old ^ v)
#define EMU_CAS(T) inline T atomicCAS(T* a, T cmp, T v) { T old = *a; if (old == cmp) *a = v; return old; }
EMU_CAS(int) EMU_CAS(unsigned int) EMU_CAS(unsigned long long) EMU_CAS(unsigned short)

// Math: <cmath> has the float and double overloads; these are the CUDA-only names.
template <class A, class B> inline auto max(A a, B b) -> decltype(a + b) { return a > b ? a : b; }
template <class A, class B> inline auto min(A a, B b) -> decltype(a + b) { return a < b ? a : b; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
inline long long __double_as_longlong(double d) { long long i; memcpy(&i, &d, 8); return i; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
template <class T> inline T __ldg(const T* p) { return *p; }
