// Forward and backward scores of the stay/move lattice, in log space, in any semiring (written by
// nbs/03_ctc_simple.ipynb). Grid (N, 2): block (n, 0) runs the forward recursion of sequence n, block (n, 1) the
// backward one, at the same time (as seqdist 0.0.3 did): T steps in all, where two launches in turn took 2T.
// Thread i owns states i, i + blockDim.x, ... (the loop is the path for targets longer than the block); the
// previous frame is double-buffered in shared memory, so one barrier per frame suffices.
#include "semiring.cuh"

__device__ void simple_alpha(const FLOAT* __restrict__ stay, const FLOAT* __restrict__ move, int Ln,
                             FLOAT* __restrict__ alpha, FLOAT* buf, int T, int N, int L, int n) {
    for (int s = threadIdx.x; s < L; s += blockDim.x) buf[s] = alpha[(long long)n * L + s] = s == 0 ? ONE : ZERO;
    __syncthreads();
    for (int t = 0; t < T; t++) {
        const FLOAT* prev = buf + (t % 2) * L;
        FLOAT* cur = buf + ((t + 1) % 2) * L;
        const long long row = ((long long)t * N + n);
        for (int s = threadIdx.x; s < L; s += blockDim.x) {
            FLOAT a = s < Ln ? MUL(stay[row * L + s], prev[s]) : ZERO;
            if (s > 0 && s < Ln) a = SUM(a, MUL(move[row * (L - 1) + s - 1], prev[s - 1]));
            cur[s] = a;
            alpha[(row + N) * L + s] = a;
        }
        __syncthreads();
    }
}

__device__ void simple_beta(const FLOAT* __restrict__ stay, const FLOAT* __restrict__ move, int Ln,
                            FLOAT* __restrict__ beta, FLOAT* buf, int T, int N, int L, int n) {
    for (int s = threadIdx.x; s < L; s += blockDim.x)
        buf[(T % 2) * L + s] = beta[((long long)T * N + n) * L + s] = s == Ln - 1 ? ONE : ZERO;
    __syncthreads();
    for (int t = T - 1; t >= 0; t--) {
        const FLOAT* next = buf + ((t + 1) % 2) * L;
        FLOAT* cur = buf + (t % 2) * L;
        const long long row = ((long long)t * N + n);
        for (int s = threadIdx.x; s < L; s += blockDim.x) {
            FLOAT b = s < Ln ? MUL(stay[row * L + s], next[s]) : ZERO;
            if (s + 1 < Ln) b = SUM(b, MUL(move[row * (L - 1) + s], next[s + 1]));
            cur[s] = b;
            beta[row * L + s] = b;
        }
        __syncthreads();
    }
}

extern "C" __global__ void simple_alpha_beta(const FLOAT* __restrict__ stay, const FLOAT* __restrict__ move,
                                             const long long* __restrict__ lengths, FLOAT* __restrict__ alpha,
                                             FLOAT* __restrict__ beta, int T, int N, int L) {
    extern __shared__ unsigned char smem[];
    FLOAT* buf = (FLOAT*)smem;                        // 2 * L values
    const int n = blockIdx.x, Ln = (int)lengths[n];
    if (blockIdx.y == 0) simple_alpha(stay, move, Ln, alpha, buf, T, N, L, n);
    else simple_beta(stay, move, Ln, beta, buf, T, N, L, n);
}

// The edge posteriors (Log semiring) in one pass: gs[t, n, s] = exp(alpha_t(s) + stay[t, n, s] + beta_{t+1}(s) - logZ),
// gm[t, n, s] = exp(alpha_t(s) + move[t, n, s] + beta_{t+1}(s + 1) - logZ), zero for an infeasible sequence
// (logZ = -inf). alpha and beta (T + 1, N, L) are double; one thread per (t, n, s); written in the scores' type.
extern "C" __global__ void simple_posteriors(const double* __restrict__ alpha, const double* __restrict__ beta,
                                             const FLOAT* __restrict__ stay, const FLOAT* __restrict__ move,
                                             const double* __restrict__ logz, FLOAT* __restrict__ gs,
                                             FLOAT* __restrict__ gm, int T, int N, int L) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * N * L) return;
    const int s = (int)(i % L);
    const long long tn = i / L, m = tn * (L - 1) + s;          // (t, n) and the move edge out of s
    const double z = logz[tn % N];
    const bool feasible = z != -INFINITY;
    const double a = alpha[i];
    const double* b = beta + (long long)N * L + i;             // beta_{t+1}(s)
    gs[i] = feasible ? (FLOAT)exp(a + (double)stay[i] + b[0] - z) : (FLOAT)0;
    if (s + 1 < L) gm[m] = feasible ? (FLOAT)exp(a + (double)move[m] + b[1] - z) : (FLOAT)0;
}
