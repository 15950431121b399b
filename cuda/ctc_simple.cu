// Forward and backward scores of the stay/move lattice, in log space, in any semiring (written by
// nbs/03_ctc_simple.ipynb). Grid (N, 2): block (n, 0) runs the forward recursion of sequence n, block (n, 1) the
// backward one, at the same time (as seqdist 0.0.3 did): T steps in all, where two launches in turn took 2T.
// Thread i owns states i, i + blockDim.x, ... (the loop is the path for targets longer than the block); the
// previous frame is double-buffered in shared memory, so one barrier per frame suffices. Each thread loads its first
// state's scores of the next frame before that barrier (`NEXT`), so their latency overlaps the barrier's wait, not
// the recursion's path; a thread's other states (targets longer than the block) load theirs in turn.
#include "semiring.cuh"
// stay[t, n, s] and move[t, n, s] as the forward recursion reads them (ZERO past the sequence's states)...
#define STAY(t, s) ((s) < Ln ? stay[((long long)(t) * N + n) * L + (s)] : ZERO)
#define MOVE_IN(t, s) ((s) > 0 && (s) < Ln ? move[((long long)(t) * N + n) * (L - 1) + (s) - 1] : ZERO)
// ... and the move out of s, as the backward one does
#define MOVE_OUT(t, s) ((s) + 1 < Ln ? move[((long long)(t) * N + n) * (L - 1) + (s)] : ZERO)

// With `poisoned` (N flags, else null): the forward recursion reads every score of the lattice once (stay u < L_n, move
// u < L_n - 1) and flags a NaN or +inf; a flagged sequence's alpha_T(L_n - 1), its logZ, is NaN (PyTorch's semantics:
// a pass of PyTorch operations over the scores did it, and a copy with the padding zeroed). With LOG2 (float Log,
// `$SEQDIST_CTC_SIMPLE_LOG2=1`) buf holds log2-scaled scores, each score enters by EMIT, alpha and beta natural logs.
__device__ void simple_alpha(const FLOAT* __restrict__ stay, const FLOAT* __restrict__ move, int Ln,
                             FLOAT* __restrict__ alpha, FLOAT* buf, int T, int N, int L, int n, int* poisoned) {
    for (int s = threadIdx.x; s < L; s += blockDim.x) buf[s] = alpha[(long long)n * L + s] = s == 0 ? ONE : ZERO;
    if (poisoned && threadIdx.x == 0) poisoned[n] = 0;
    const int s0 = threadIdx.x;                             // this thread's first state
    FLOAT x0 = T > 0 && s0 < L ? STAY(0, s0) : ZERO, y0 = T > 0 && s0 < L ? MOVE_IN(0, s0) : ZERO;   // (NEXT)
    __syncthreads();
    for (int t = 0; t < T; t++) {
        const FLOAT* prev = buf + (t % 2) * L;
        FLOAT* cur = buf + ((t + 1) % 2) * L;
        const long long row = ((long long)t * N + n);
        for (int s = s0; s < L; s += blockDim.x) {
            const FLOAT x = s == s0 ? x0 : STAY(t, s), y = s == s0 ? y0 : MOVE_IN(t, s);
            if (poisoned && !(x < (FLOAT)INFINITY && y < (FLOAT)INFINITY)) poisoned[n] = 1;
            FLOAT a = s < Ln ? EMIT(prev[s], x) : ZERO;
            if (s > 0 && s < Ln) a = SUM(a, EMIT(prev[s - 1], y));
            cur[s] = a;
            alpha[(row + N) * L + s] = NATURAL(a);
        }
        if (t + 1 < T && s0 < L) { x0 = STAY(t + 1, s0); y0 = MOVE_IN(t + 1, s0); }   // NEXT
        __syncthreads();
    }
    if (poisoned && threadIdx.x == 0 && poisoned[n]) alpha[((long long)T * N + n) * L + Ln - 1] = (FLOAT)INFINITY - (FLOAT)INFINITY;
}

__device__ void simple_beta(const FLOAT* __restrict__ stay, const FLOAT* __restrict__ move, int Ln,
                            FLOAT* __restrict__ beta, FLOAT* buf, int T, int N, int L, int n) {
    for (int s = threadIdx.x; s < L; s += blockDim.x)
        buf[(T % 2) * L + s] = beta[((long long)T * N + n) * L + s] = s == Ln - 1 ? ONE : ZERO;
    const int s0 = threadIdx.x;
    FLOAT x0 = T > 0 && s0 < L ? STAY(T - 1, s0) : ZERO, y0 = T > 0 && s0 < L ? MOVE_OUT(T - 1, s0) : ZERO;   // (NEXT)
    __syncthreads();
    for (int t = T - 1; t >= 0; t--) {
        const FLOAT* next = buf + ((t + 1) % 2) * L;
        FLOAT* cur = buf + (t % 2) * L;
        const long long row = ((long long)t * N + n);
        for (int s = s0; s < L; s += blockDim.x) {
            const FLOAT x = s == s0 ? x0 : STAY(t, s), y = s == s0 ? y0 : MOVE_OUT(t, s);
            FLOAT b = s < Ln ? EMIT(next[s], x) : ZERO;
            if (s + 1 < Ln) b = SUM(b, EMIT(next[s + 1], y));
            cur[s] = b;
            beta[row * L + s] = NATURAL(b);
        }
        if (t > 0 && s0 < L) { x0 = STAY(t - 1, s0); y0 = MOVE_OUT(t - 1, s0); }     // NEXT
        __syncthreads();
    }
}

#undef STAY
#undef MOVE_IN
#undef MOVE_OUT

extern "C" __global__ void simple_alpha_beta(const FLOAT* __restrict__ stay, const FLOAT* __restrict__ move,
                                             const long long* __restrict__ lengths, FLOAT* __restrict__ alpha,
                                             FLOAT* __restrict__ beta, int* poisoned, int T, int N, int L) {
    extern __shared__ unsigned char smem[];
    FLOAT* buf = (FLOAT*)smem;                        // 2 * L values
    const int n = blockIdx.x, Ln = (int)lengths[n];
    if (blockIdx.y == 0) simple_alpha(stay, move, Ln, alpha, buf, T, N, L, n, poisoned);
    else simple_beta(stay, move, Ln, beta, buf, T, N, L, n);
}

// The edge posteriors (Log semiring): one block per frame and sequence (t, n) takes the weights of the frame's edges,
// w = alpha_t(s) + stay[t, n, s] + beta_{t+1}(s) and alpha_t(s) + move[t, n, s] + beta_{t+1}(s + 1), and writes
// exp(w - their log-sum-exp). Every path takes one edge per frame, so that sum is Z in exact arithmetic; normalising
// each frame by its own sum (as seqdist 0.0.3 did) cancels the rounding that alpha_t + beta_{t+1} share, which in
// float32 dominates the error of exp(w - logZ). Zero for an infeasible sequence (logz = -inf) and past a sequence's
// edges (stay u >= L_n, move u >= L_n - 1: their scores are not read), NaN for a poisoned one (logz NaN). blockDim.x
// is a power of two; the reductions are trees in shared memory (deterministic).
extern "C" __global__ void simple_posteriors(const FLOAT* __restrict__ alpha, const FLOAT* __restrict__ beta,
                                             const FLOAT* __restrict__ stay, const FLOAT* __restrict__ move,
                                             const FLOAT* __restrict__ logz, const long long* __restrict__ lengths,
                                             FLOAT* __restrict__ gs, FLOAT* __restrict__ gm, int N, int L) {
    extern __shared__ unsigned char smem[];
    FLOAT* red = (FLOAT*)smem;                       // blockDim.x values
    const long long tn = blockIdx.x;                 // t * N + n
    const FLOAT* a = alpha + tn * L;
    const FLOAT* b = beta + (tn + N) * L;            // beta_{t+1}
    const FLOAT* st = stay + tn * L;
    const FLOAT* mv = move + tn * (L - 1);
    FLOAT* os = gs + tn * L;
    FLOAT* om = gm + tn * (L - 1);
    const FLOAT z = logz[tn % N];
    const int Ln = (int)lengths[tn % N];
    if (z == -INFINITY || z != z) {                  // the same for the whole block: no barrier is skipped by some
        for (int s = threadIdx.x; s < L; s += blockDim.x) { os[s] = z == z ? 0 : z; if (s + 1 < L) om[s] = z == z ? 0 : z; }
        return;
    }
    FLOAT m = -INFINITY;
    for (int s = threadIdx.x; s < Ln; s += blockDim.x) {
        m = max2(m, a[s] + st[s] + b[s]);
        if (s + 1 < Ln) m = max2(m, a[s] + mv[s] + b[s + 1]);
    }
    red[threadIdx.x] = m;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) red[threadIdx.x] = max2(red[threadIdx.x], red[threadIdx.x + k]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();                                 // everyone has read red[0] before it is reused
    FLOAT sum = 0;
    for (int s = threadIdx.x; s < Ln; s += blockDim.x) {
        sum += exp(a[s] + st[s] + b[s] - m);
        if (s + 1 < Ln) sum += exp(a[s] + mv[s] + b[s + 1] - m);
    }
    red[threadIdx.x] = sum;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) red[threadIdx.x] += red[threadIdx.x + k];
        __syncthreads();
    }
    const FLOAT lse = m + log(red[0]);
    for (int s = threadIdx.x; s < L; s += blockDim.x) {
        os[s] = s < Ln ? exp(a[s] + st[s] + b[s] - lse) : (FLOAT)0;
        if (s + 1 < L) om[s] = s + 1 < Ln ? exp(a[s] + mv[s] + b[s + 1] - lse) : (FLOAT)0;
    }
}
