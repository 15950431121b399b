// Semiring sums for seqdist's kernels, and a block-wide reduction (written by nbs/00_core.ipynb). A kernel is
// specialised to a semiring by the macros FLOAT, ZERO, ONE, MUL(a, b), SUM(a, b), SUM3(a, b, c), and for an n-ary sum
// (the max m of the terms first) SUM_TERM(x, m) and SUM_END(m, s) (see seqdist.core.semiring.cuda_macros).
#pragma once

#ifndef INFINITY   // NVRTC compiles without the C math headers
#define INFINITY __int_as_float(0x7f800000)
#endif

template <class T> __device__ __forceinline__ T max2(T a, T b) { return a > b ? a : b; }
template <class T> __device__ __forceinline__ T max3(T a, T b, T c) { return max2(max2(a, b), c); }

// log(e^a + e^b (+ e^c)): the largest m plus log1p of the others' e^(x - m): one exp fewer than e^(x - m) for each term
// (the largest's is 1). A NaN anywhere gives NaN (the max is taken so that it cannot drop one), and (m - m) gives NaN
// for an infinite m, as e^(m - m) did.
template <class T> __device__ __forceinline__ T logsumexp2(T a, T b) {
    const T m = max2(a, b), lo = a > b ? b : a;
    return m + (log1p(exp(lo - m)) + (m - m));
}
template <class T> __device__ __forceinline__ T logsumexp3(T a, T b, T c) {
    const T hi = max2(a, b), lo = a > b ? b : a, m = max2(c, hi), mid = c > hi ? hi : c;
    return m + (log1p(exp(lo - m) + exp(mid - m)) + (m - m));
}

// The same sums in base 2, for float (log2(2^a + 2^b (+ 2^c)) of log2-scaled values; the recursions' LOG2 variants):
// ex2 and lg2 are single instructions of the special function unit (ex2_ftz: 2 ulp; __log2f of an argument in [1, 3]:
// within 2^-21.4), where e^x and log1p are sequences of some twenty. Same order of terms, same NaN.
__device__ __forceinline__ float ex2_ftz(float x) {   // 2^x: one MUFU instruction (results below 2^-126 flushed to 0,
#ifdef __CUDA_ARCH__                                   // a term's share of a sum; exp2f adds a denormal's scaling)
    float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
#else
    return exp2f(x);                                   // (the emulator)
#endif
}
__device__ __forceinline__ float log2sumexp2(float a, float b) {
    const float m = max2(a, b), lo = a > b ? b : a;
    return m + (__log2f(1.0f + ex2_ftz(lo - m)) + (m - m));
}
__device__ __forceinline__ float log2sumexp3(float a, float b, float c) {
    const float hi = max2(a, b), lo = a > b ? b : a, m = max2(c, hi), mid = c > hi ? hi : c;
    return m + (__log2f(1.0f + ex2_ftz(lo - m) + ex2_ftz(mid - m)) + (m - m));
}
// A kernel compiled with them (`LOG2`: `seqdist.core.semiring.cuda_macros(base2=True)`) keeps its scores in base 2 and
// scales those it reads and writes: EMIT(v, e) is v times a score e given as a natural log (one FMA), NATURAL(v) its
// own score v as a natural log. In every other kernel both are the semiring's own.
#if defined(LOG2) && LOG2
#define TO_BASE 1.4426950408889634                              // log2 e
#define EMIT(v, e) fmaf((e), (float)TO_BASE, (v))
#define NATURAL(v) ((v) * 0.6931471805599453f)                   // ln 2
#else
#define TO_BASE 1.0
#define EMIT(v, e) MUL(v, e)
#define NATURAL(v) (v)
#endif

// The max (IS_MAX) or the sum of x over the threads of the block, returned to every thread: shuffles within each
// warp, then one value per warp through `slots` (32 of them, in shared memory) and shuffles again. Every thread of
// the block calls it, blockDim.x a multiple of 32.
template <bool IS_MAX, class T> __device__ T block_reduce(T x, T* slots) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    for (int o = 16; o > 0; o /= 2) { T y = __shfl_xor_sync(0xffffffff, x, o); x = IS_MAX ? max2(x, y) : x + y; }
    __syncthreads();                          // the slots are free: a previous reduction has been read
    if (lane == 0) slots[warp] = x;
    __syncthreads();
    x = lane < nwarps ? slots[lane] : (IS_MAX ? (T)-INFINITY : (T)0);
    for (int o = 16; o > 0; o /= 2) { T y = __shfl_xor_sync(0xffffffff, x, o); x = IS_MAX ? max2(x, y) : x + y; }
    return x;
}

// The algebras of the lattice questions (seqdist.core, "The algebra in the kernels"): a state (p, q, c) in double,
// summed three at a time (`alg_plus3<A>`, A an algebra) as the numba kernels' `alg_plus3`, with the same care: each share w_i and -log w_i, the
// largest's -log as log1p of the others' sum (exact however small), a share below e^-301 of the largest dropped.
// ALG_LOG: p = logsumexp; ALG_ENTROPY: c = sum_i w_i (c_i - log w_i); ALG_KL: also q, and c = sum_i w_i (c_i + log w_i
// - log v_i), v the shares of the q. A term of weight 0 adds 0 (not 0 * inf).
enum { ALG_LOG = 0, ALG_ENTROPY = 1, ALG_KL = 2 };
struct AlgState { double p, q, c; };

__device__ __forceinline__ double alg_shares3(double a0, double a1, double a2, double* w, double* nl) {
    const double m = max3(a0, a1, a2), mm = m > -INFINITY ? m : 0.0;
    const double d[3] = {a0 - mm, a1 - mm, a2 - mm};
    const int top = d[0] == 0.0 ? 0 : (d[1] == 0.0 ? 1 : 2);      // the largest (the first of equals)
    double e[3], rest = 0.0;
    #pragma unroll
    for (int i = 0; i < 3; i++) {
        e[i] = i == top ? (m > -INFINITY ? 1.0 : 0.0) : (d[i] > -301.0 ? exp(d[i]) : 0.0);
        if (i != top) rest += e[i];
    }
    const double l = log1p(rest), inv = 1.0 / (1.0 + rest);
    #pragma unroll
    for (int i = 0; i < 3; i++) { w[i] = e[i] * inv; nl[i] = l - d[i]; }
    return m + l;
}

template <int A> __device__ __forceinline__ AlgState alg_plus3(AlgState x, AlgState y, AlgState z) {
    double w[3], n[3];
    AlgState r;
    r.p = alg_shares3(x.p, y.p, z.p, w, n);
    r.q = -INFINITY; r.c = 0.0;
    if (A == ALG_LOG) return r;
    const double c[3] = {x.c, y.c, z.c};
    if (A == ALG_ENTROPY) {
        #pragma unroll
        for (int i = 0; i < 3; i++) r.c += w[i] > 0.0 ? w[i] * (c[i] + n[i]) : 0.0;
        return r;
    }
    double v[3], m[3];
    r.q = alg_shares3(x.q, y.q, z.q, v, m);
    #pragma unroll
    for (int i = 0; i < 3; i++) r.c += w[i] > 0.0 ? w[i] * (c[i] + (m[i] - n[i])) : 0.0;
    return r;
}

// The states of a lattice's nodes in a (3, nodes) array of doubles: p, q, c at n, stride + n, 2 stride + n.
__device__ __forceinline__ AlgState alg_load(const double* s, long long stride, long long n) {
    AlgState x; x.p = s[n]; x.q = s[stride + n]; x.c = s[2 * stride + n]; return x;
}
__device__ __forceinline__ void alg_store(double* s, long long stride, long long n, AlgState x) {
    s[n] = x.p; s[stride + n] = x.q; s[2 * stride + n] = x.c;
}
__device__ __forceinline__ AlgState alg_state(double p, double q, double c) { AlgState x; x.p = p; x.q = q; x.c = c; return x; }
__device__ __forceinline__ AlgState alg_times(AlgState x, double sp, double sq) { x.p += sp; x.q += sq; return x; }

// The gradient of the accumulator w.r.t. the scores (s_p, s_q) of one edge, from the forward state f at its tail and
// the backward state w at its head: entropy -mu (log mu - H_before - H_after + H); KL mu_p (log mu_p - log mu_q +
// KL_before + KL_after - KL) for p and mu_q - mu_p for q (mu the edge's posterior).
template <int A> __device__ __forceinline__ void alg_edge_grad(AlgState f, double sp, double sq, AlgState w, double zp,
                                                               double zq, double total, double* gp, double* gq) {
    const double lmp = f.p + sp + w.p - zp, mp = lmp > -700.0 ? exp(lmp) : 0.0;
    if (A == ALG_ENTROPY) { *gp = mp > 0.0 ? -mp * (lmp - f.c - w.c + total) : 0.0; *gq = 0.0; return; }
    const double lmq = f.q + sq + w.q - zq, mq = lmq > -700.0 ? exp(lmq) : 0.0;
    *gp = mp > 0.0 ? mp * (lmp - lmq + f.c + w.c - total) : 0.0;
    *gq = mq - mp;
}

// For the CUDA samplers: the index (0, 1 or 2) that the uniform u picks among weights w (linear, relative to their
// largest), as the CPU kernels' `pick3` picks: the first whose cumulative weight exceeds u times the total, never one
// of weight 0. `pick_log3` takes the weights' logs.
__device__ __forceinline__ int pick3(double w0, double w1, double w2, double u) {
    const double c1 = w0 + w1, total = c1 + w2;
    const int i = (w0 <= u * total ? 1 : 0) + (c1 <= u * total ? 1 : 0);
    const int last = w2 > 0.0 ? 2 : (w1 > 0.0 ? 1 : 0);
    return i < last ? i : last;
}
__device__ __forceinline__ int pick_log3(double a0, double a1, double a2, double u) {
    const double m = max3(a0, a1, a2);
    return pick3(a0 > -INFINITY ? exp(a0 - m) : 0.0, a1 > -INFINITY ? exp(a1 - m) : 0.0, a2 > -INFINITY ? exp(a2 - m) : 0.0, u);
}

// For the CUDA samplers over many candidates: the index that the uniform u picks among `count` log-weights w(k) (a
// functor, called three times a candidate so that a thread keeps no array), as `choose_index` picks: the weights
// relative to their largest, the first whose running sum exceeds u times the total, never one of weight 0. The loops
// are unrolled so that eight candidates' loads are in flight together (the first pass waits on memory once, not once
// a candidate; the later passes find them in the L1 cache).
template <class Weights> __device__ __forceinline__ int choose_log(const Weights& w, int count, double u) {
    double m = -INFINITY, total = 0.0, c = 0.0;
    #pragma unroll 8
    for (int k = 0; k < count; k++) m = fmax(m, w(k));
    int last = 0, pick = 0;
    #pragma unroll 4
    for (int k = 0; k < count; k++) {
        const double x = w(k), e = x > -INFINITY ? exp(x - m) : 0.0;
        if (e > 0.0) last = k;
        total += e;
    }
    const double bound = u * total;
    #pragma unroll 4
    for (int k = 0; k < count - 1; k++) {                   // the running sums at most u times the total
        const double x = w(k);
        c += x > -INFINITY ? exp(x - m) : 0.0;
        pick += c <= bound ? 1 : 0;
    }
    return pick < last ? pick : last;
}

// For the CUDA k-best kernels (KMax(k)'s sum of three states), as the CPU kernels' `merge_top3`: the k largest of three
// sorted (descending) lists a, b, c of length k, into out, and for each where it came from, `code` = 16 * list + rank
// (ties: the earlier list first; a signed char holds it for k <= 16). -inf past the values that exist.
__device__ void merge_top3(int k, const double* a, const double* b, const double* c, double* out, signed char* code) {
    int i = 0, j = 0, l = 0;
    for (int r = 0; r < k; r++) {
        const double va = i < k ? a[i] : -INFINITY, vb = j < k ? b[j] : -INFINITY, vc = l < k ? c[l] : -INFINITY;
        if (va >= vb && va >= vc) { out[r] = va; code[r] = (signed char)i; i++; }
        else if (vb >= vc) { out[r] = vb; code[r] = (signed char)(16 + j); j++; }
        else { out[r] = vc; code[r] = (signed char)(32 + l); l++; }
    }
}
