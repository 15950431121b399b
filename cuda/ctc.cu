// CTC forward-backward over the 2L+1-state lattice, in log space, in any semiring (written by nbs/02_ctc.ipynb).
#include "semiring.cuh"

__device__ __forceinline__ bool may_skip(const long long* ext, int s, int blank) {
    return s >= 2 && ext[s] != blank && ext[s] != ext[s - 2];
}

// alpha[t, n, s]: the semiring sum of the scores of the paths that are in state s after emitting frame t.
// One block per sequence; thread i owns states i, i + blockDim.x, ... (the loop is the path for lattices larger
// than the block). The previous frame lives in shared memory, double-buffered: one barrier per frame suffices.
extern "C" __global__ void ctc_alpha(
    const FLOAT* __restrict__ lp, const long long* __restrict__ ext, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, FLOAT* __restrict__ alpha, FLOAT* __restrict__ logz,
    int N, int C, int S_max, int blank)
{
    extern __shared__ unsigned char smem[];
    FLOAT* buf = (FLOAT*)smem;                        // 2 * S_max values
    const int n = blockIdx.x, T = (int)input_lengths[n], S = 2 * (int)target_lengths[n] + 1;
    const long long* e = ext + (long long)n * S_max;
    for (int t = 0; t < T; t++) {
        const FLOAT* prev = buf + ((t + 1) % 2) * S_max;
        FLOAT* cur = buf + (t % 2) * S_max;
        for (int s = threadIdx.x; s < S; s += blockDim.x) {
            FLOAT v;
            if (t == 0) v = s < 2 ? ONE : ZERO;
            else {
                v = prev[s];
                if (s >= 1) v = SUM(v, prev[s - 1]);
                if (may_skip(e, s, blank)) v = SUM(v, prev[s - 2]);
            }
            v = MUL(v, lp[((long long)t * N + n) * C + e[s]]);
            cur[s] = v;
            alpha[((long long)t * N + n) * S_max + s] = v;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const FLOAT* last = buf + ((T + 1) % 2) * S_max;
        logz[n] = T == 0 ? (S == 1 ? ONE : ZERO) : (S > 1 ? SUM(last[S - 1], last[S - 2]) : last[0]);
    }
}

// beta_t(s) (the paths from state s after frame t to the end, excluding frame t's emission), combined in place:
// alpha[t, n, s] becomes alpha_t(s) * beta_t(s), the (unnormalised) weight of state s at frame t.
extern "C" __global__ void ctc_beta(
    const FLOAT* __restrict__ lp, const long long* __restrict__ ext, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, FLOAT* __restrict__ alpha, int N, int C, int S_max, int blank)
{
    extern __shared__ unsigned char smem[];
    FLOAT* buf = (FLOAT*)smem;
    const int n = blockIdx.x, T = (int)input_lengths[n], S = 2 * (int)target_lengths[n] + 1;
    const long long* e = ext + (long long)n * S_max;
    for (int t = T - 1; t >= 0; t--) {
        const FLOAT* next = buf + ((t + 1) % 2) * S_max;
        FLOAT* cur = buf + (t % 2) * S_max;
        const FLOAT* lp_next = lp + ((long long)(t + 1) * N + n) * C;
        for (int s = threadIdx.x; s < S; s += blockDim.x) {
            FLOAT b;
            if (t == T - 1) b = s >= S - 2 ? ONE : ZERO;
            else {
                b = MUL(next[s], lp_next[e[s]]);
                if (s + 1 < S) b = SUM(b, MUL(next[s + 1], lp_next[e[s + 1]]));
                if (s + 2 < S && may_skip(e, s + 2, blank)) b = SUM(b, MUL(next[s + 2], lp_next[e[s + 2]]));
            }
            cur[s] = b;
            FLOAT* a = alpha + ((long long)t * N + n) * S_max + s;
            *a = MUL(*a, b);
        }
        __syncthreads();
    }
}

// Posteriors from the state weights: out[t, n, k] -= weight * posterior, where k is the state (by_state) or its
// label. Log: posterior = exp(w - logz); Max: 1 at the first best state of each frame. One thread per (t, n),
// which visits its states in order: no two threads write the same element, and no atomics (deterministic).
extern "C" __global__ void ctc_posteriors(
    const FLOAT* __restrict__ w, const long long* __restrict__ ext, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, const FLOAT* __restrict__ logz, const FLOAT* __restrict__ weight,
    FLOAT* __restrict__ out, int T_max, int N, int K, int S_max, int by_state, int use_max)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T_max * N) return;   // no barrier in this kernel, so an early exit is safe
    const int t = (int)(i / N), n = (int)(i % N);
    if (t >= input_lengths[n] || weight[n] == 0) return;
    const int S = 2 * (int)target_lengths[n] + 1;
    const FLOAT* wt = w + ((long long)t * N + n) * S_max;
    const long long* e = ext + (long long)n * S_max;
    FLOAT* o = out + ((long long)t * N + n) * K;
    if (use_max) {
        int best = 0;
        for (int s = 1; s < S; s++) if (wt[s] > wt[best]) best = s;
        o[by_state ? best : e[best]] -= weight[n];
    } else {
        for (int s = 0; s < S; s++) o[by_state ? s : e[s]] -= weight[n] * exp(wt[s] - logz[n]);
    }
}
