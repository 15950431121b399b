// Sparse-transition CRF: forward and backward scores and edge posteriors, in log space, in any semiring
// (written by nbs/04_sparse.ipynb). Ms (T, N, C, NZ): score of entering state c by its j-th edge, from idx[c, j].
#include "semiring.cuh"
#ifndef SPARSE_GROUP
#define SPARSE_GROUP 5     // a state's edges read this many at a time: a DNA CTC-CRF's 5 (4 moves, a stay) in one
#endif                     // group (8 spill float's 32 registers on sm_90)

// The semiring's sum of `count` terms x(j) (a functor) as SUM_TERM and SUM_END take it: their max first, then the
// others in order (the max's own term, once, is SUM_END's). The terms are read SPARSE_GROUP at a time, past `count`
// the last again and masked, so that a group's loads are in flight together (no branch between them: one wait on
// memory a group, where a loop over the edges waited once an edge). Past the first pass they come from the L1 cache.
template <class Terms> __device__ __forceinline__ FLOAT grouped_sum(const Terms& x, int count) {
    FLOAT m = ZERO, s = 0;
    for (int j0 = 0; j0 < count; j0 += SPARSE_GROUP) {
        #pragma unroll
        for (int g = 0; g < SPARSE_GROUP; g++) {
            const FLOAT v = x(min(j0 + g, count - 1));
            m = j0 + g < count ? max2(m, v) : m;
        }
    }
    bool top = false;
    for (int j0 = 0; j0 < count; j0 += SPARSE_GROUP) {
        #pragma unroll
        for (int g = 0; g < SPARSE_GROUP; g++) {
            const FLOAT v = x(min(j0 + g, count - 1));
            const bool real = j0 + g < count, own = real && !top && v == m;
            top = top || own;
            s += real && !own ? SUM_TERM(v, m) : (FLOAT)0;
        }
    }
    return SUM_END(m, s);                 // (no term equal to m: m is ZERO, whose own term that is)
}
// State c's in-edges at a frame: term j its score times its source's score (`bad`: a NaN or +inf score seen). EMIT:
// the edge's score (a natural log) into the recursion's base (semiring.cuh: base 2 with LOG2, else the product).
struct InEdges {
    const FLOAT* M; const int* idx; const FLOAT* prev; bool* bad;
    __device__ FLOAT operator()(int j) const { const FLOAT w = M[j]; *bad |= !(w < (FLOAT)INFINITY); return EMIT(prev[idx[j]], w); }
};
// State s's out-edges at a frame: term k its score times its end's backward score.
struct OutEdges {
    const FLOAT* M; const int* out; const FLOAT* next; int NZ;
    __device__ FLOAT operator()(int k) const { const int e = out[k]; return EMIT(next[e / NZ], M[e]); }
};

// One block per sequence; thread i owns states i, i + blockDim.x, ... (K = C / blockDim.x of them: a tuning knob).
// The previous frame's scores are in shared memory (buf), double-buffered: one barrier per frame. With `poisoned` (N
// flags, else null), a NaN or +inf among the scores it reads (every one of Ms, v0 and vT, once) makes the sequence's
// alpha_T NaN, so its logZ and gradient are: PyTorch's semantics, which a pass of PyTorch operations found before.
// With LOG2 (float Log, `$SEQDIST_SPARSE_LOG2=1`) buf holds log2-scaled scores, alpha and beta natural logs.
__device__ void forward_scores(const FLOAT* __restrict__ Ms, const int* __restrict__ idx, const FLOAT* __restrict__ v0,
                               FLOAT* __restrict__ alpha, FLOAT* buf, int T, int N, int C, int NZ, int n,
                               const FLOAT* __restrict__ vT, int* poisoned) {
    for (int c = threadIdx.x; c < C; c += blockDim.x) buf[c] = EMIT((FLOAT)ONE, alpha[(long long)n * C + c] = v0[(long long)n * C + c]);
    if (poisoned && threadIdx.x == 0) poisoned[n] = 0;
    __syncthreads();
    if (poisoned)
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            if (!(v0[(long long)n * C + c] < (FLOAT)INFINITY && vT[(long long)n * C + c] < (FLOAT)INFINITY)) poisoned[n] = 1;
    for (int t = 0; t < T; t++) {
        const FLOAT* prev = buf + (t % 2) * C;
        FLOAT* cur = buf + ((t + 1) % 2) * C;
        const FLOAT* M = Ms + ((long long)t * N + n) * C * NZ;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {      // an n-ary sum (SUM_TERM): the terms independent
            bool bad = false;
            const FLOAT a = grouped_sum(InEdges{M + (long long)c * NZ, idx + (long long)c * NZ, prev, &bad}, NZ);
            if (poisoned && bad) poisoned[n] = 1;
            cur[c] = a;
            alpha[((long long)(t + 1) * N + n) * C + c] = NATURAL(a);
        }
        __syncthreads();
    }
    if (!poisoned) return;
    __syncthreads();                                              // (T = 0: the ends' flags)
    if (poisoned[n])
        for (int c = threadIdx.x; c < C; c += blockDim.x) alpha[((long long)T * N + n) * C + c] = (FLOAT)INFINITY - (FLOAT)INFINITY;
}

// beta[t, s] = sum over the edges e leaving s (e = c * NZ + j with idx[c, j] = s) of Ms[t, e] * beta[t + 1, c].
// out_edges lists, for each state, its NZ edges (every state has NZ of them: checked by the caller), so each thread
// reads rather than scatters, and no atomics are needed.
__device__ void backward_scores(const FLOAT* __restrict__ Ms, const int* __restrict__ out_edges, const FLOAT* __restrict__ vT,
                                FLOAT* __restrict__ beta, FLOAT* buf, int T, int N, int C, int NZ, int n) {
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        buf[(T % 2) * C + c] = EMIT((FLOAT)ONE, beta[((long long)T * N + n) * C + c] = vT[(long long)n * C + c]);
    __syncthreads();
    for (int t = T - 1; t >= 0; t--) {
        const FLOAT* next = buf + ((t + 1) % 2) * C;
        FLOAT* cur = buf + (t % 2) * C;
        const FLOAT* M = Ms + ((long long)t * N + n) * C * NZ;
        for (int s = threadIdx.x; s < C; s += blockDim.x) {
            const FLOAT b = grouped_sum(OutEdges{M, out_edges + (long long)s * NZ, next, NZ}, NZ);
            cur[s] = b;
            beta[((long long)t * N + n) * C + s] = NATURAL(b);
        }
        __syncthreads();
    }
}

// float on sm_90: at most 32 registers, so that two blocks of 1024 threads (C = 1024, a CTC-CRF of state_len 5) share
// an SM and sparse_fwd_bwd's grid (N, 2) runs in one wave of an H100/H200 up to N = 132 (with 38, one block an SM: two
// waves at N = 128). On sm_80, 32 registers spill, and bounds of one block let the compiler take 64: none. Also none
// with SPARSE_TWO_BLOCKS=0 (the variant `$SEQDIST_SPARSE_BOUNDS=1` compares on a GPU).
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900) || !SPARSE_TWO_BLOCKS
#define SPARSE_BOUNDS
#else
#define SPARSE_BOUNDS __launch_bounds__(1024, sizeof(FLOAT) == 4 ? 2 : 1)
#endif

extern "C" __global__ void SPARSE_BOUNDS sparse_fwd(const FLOAT* __restrict__ Ms, const int* __restrict__ idx,
                                      const FLOAT* __restrict__ v0, FLOAT* __restrict__ alpha, const FLOAT* __restrict__ vT,
                                      int* poisoned, int T, int N, int C, int NZ) {
    extern __shared__ unsigned char smem[];           // 2 * C values
    forward_scores(Ms, idx, v0, alpha, (FLOAT*)smem, T, N, C, NZ, blockIdx.x, vT, poisoned);
}

extern "C" __global__ void SPARSE_BOUNDS sparse_bwd(const FLOAT* __restrict__ Ms, const int* __restrict__ out_edges,
                                      const FLOAT* __restrict__ vT, FLOAT* __restrict__ beta, int T, int N, int C, int NZ) {
    extern __shared__ unsigned char smem[];
    backward_scores(Ms, out_edges, vT, beta, (FLOAT*)smem, T, N, C, NZ, blockIdx.x);
}

// Both recursions in one launch, at the same time: grid (N, 2), block (n, 0) writes alpha = scores[0], block (n, 1)
// beta = scores[1] (scores is (2, T + 1, N, C)). T steps where the two kernels in turn take 2T.
extern "C" __global__ void SPARSE_BOUNDS sparse_fwd_bwd(const FLOAT* __restrict__ Ms, const int* __restrict__ idx,
                                          const int* __restrict__ out_edges, const FLOAT* __restrict__ v0,
                                          const FLOAT* __restrict__ vT, FLOAT* __restrict__ scores, int* poisoned,
                                          int T, int N, int C, int NZ) {
    extern __shared__ unsigned char smem[];
    if (blockIdx.y == 0) forward_scores(Ms, idx, v0, scores, (FLOAT*)smem, T, N, C, NZ, blockIdx.x, vT, poisoned);
    else backward_scores(Ms, out_edges, vT, scores + (long long)(T + 1) * N * C, (FLOAT*)smem, T, N, C, NZ, blockIdx.x);
}

// grad[t, n, e] = g[n] * posterior of edge e at frame t. Log: exp(alpha + Ms + beta - logZ). Max: 1 on the frame's
// best edge, found by a block-wide argmax (ties: the smallest edge index), so the result is deterministic.
// One block per (t, n); blockDim.x is a power of two.
extern "C" __global__ void sparse_posteriors(const FLOAT* __restrict__ Ms, const int* __restrict__ idx,
                                             const FLOAT* __restrict__ alpha, const FLOAT* __restrict__ beta,
                                             const FLOAT* __restrict__ logz, const FLOAT* __restrict__ g,
                                             FLOAT* __restrict__ grad, int N, int C, int NZ, int use_max) {
    extern __shared__ unsigned char smem[];
    FLOAT* best = (FLOAT*)smem;                       // blockDim.x values
    int* where = (int*)(best + blockDim.x);           // blockDim.x indices
    const int t = blockIdx.x, n = blockIdx.y, E = C * NZ;
    const long long frame = ((long long)t * N + n);
    const FLOAT* M = Ms + frame * E;
    const FLOAT* a = alpha + frame * C;
    const FLOAT* b = beta + (frame + N) * C;           // beta at t + 1
    FLOAT* out = grad + frame * E;
    FLOAT my_best = -INFINITY;
    int my_where = E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const FLOAT w = MUL(MUL(a[idx[e]], M[e]), b[e / NZ]);
        if (use_max) {
            out[e] = 0;
            if (w > my_best) { my_best = w; my_where = e; }
        } else {
            out[e] = g[n] * exp(w - logz[n]);
        }
    }
    if (!use_max) return;                              // uniform across the block: no barrier follows for anyone
    best[threadIdx.x] = my_best; where[threadIdx.x] = my_where;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            const FLOAT o = best[threadIdx.x + half];
            const int ow = where[threadIdx.x + half];
            if (o > best[threadIdx.x] || (o == best[threadIdx.x] && ow < where[threadIdx.x])) {
                best[threadIdx.x] = o; where[threadIdx.x] = ow;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0 && where[0] < E) out[where[0]] = g[n];
}
