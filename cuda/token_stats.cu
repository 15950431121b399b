// Token statistics of a head's output rows (written by nbs/08a_linear_cross_entropy.ipynb): the CPU kernels
// `_stats_forward_cpu` and `_stats_backward_cpu`, one block per row (grid-stride). The logits are z = softcap(y) / T
// (inv_t = 1 / T, cap 0: none), w = z - max z in the forward and w = log p = z - lse in the backward; e^w is 0 below
// -1000, so e^w max(w, -1000) is never 0 * -inf. Macro: FLOAT.
#include "semiring.cuh"

__device__ __forceinline__ FLOAT stats_capped(FLOAT v, FLOAT cap) { return cap > 0 ? cap * tanh(v / cap) : v; }

// lse[i]; ent[i] = log s - u / s (s = sum e^w, u = sum e^w w) and logp[i] = z_t - lse[i], both 0 for an ignored
// target and NaN for one out of range.
extern "C" __global__ void stats_forward(const FLOAT* __restrict__ y, const long long* __restrict__ target,
                                         long long ignore_index, FLOAT inv_t, FLOAT cap, FLOAT* __restrict__ lse,
                                         FLOAT* __restrict__ ent, FLOAT* __restrict__ logp, int M, int V) {
    __shared__ FLOAT slots[32];
    for (int row = blockIdx.x; row < M; row += gridDim.x) {
        const FLOAT* r = y + (long long)row * V;
        FLOAT m = -INFINITY, s = 0, u = 0;
        for (int c = threadIdx.x; c < V; c += blockDim.x) m = max2(m, r[c]);
        m = stats_capped(block_reduce<true>(m, slots), cap) * inv_t;     // softcap and 1/T are monotone: z's max
        for (int c = threadIdx.x; c < V; c += blockDim.x) {
            const FLOAT w = stats_capped(r[c], cap) * inv_t - m, e = exp(w);
            s += e;
            u += e * max2(w, (FLOAT)-1000);
        }
        s = block_reduce<false>(s, slots);
        u = block_reduce<false>(u, slots);
        if (threadIdx.x == 0) {
            const FLOAT ls = log(s);
            const long long t = target[row];
            lse[row] = m + ls;
            if (t == ignore_index) ent[row] = logp[row] = 0;
            else if (t < 0 || t >= V) ent[row] = logp[row] = (FLOAT)INFINITY - (FLOAT)INFINITY;
            else {
                ent[row] = ls - u / s;                                  // no cancellation for a peaked row
                logp[row] = (stats_capped(r[t], cap) * inv_t - m) - ls;
            }
        }
    }
}

// y turned in place into the gradient of sum_i g_logp[i] logp[i] + g_ent[i] ent[i] + g_lse[i] lse[i] with respect
// to y: dL/dz_v = a [v = t] - p_v (coef + b w_v) (a = g_logp, b = g_ent, coef = a + b H - g_lse), times
// dz/dy = (1 - (softcap(y) / cap)^2) / T. A row whose target is ignored (or out of range) gets 0.
extern "C" __global__ void stats_backward(FLOAT* y, const long long* __restrict__ target, long long ignore_index,
                                          FLOAT inv_t, FLOAT cap, const FLOAT* __restrict__ lse,
                                          const FLOAT* __restrict__ coef, const FLOAT* __restrict__ g_logp,
                                          const FLOAT* __restrict__ g_ent, int M, int V) {
    for (int row = blockIdx.x; row < M; row += gridDim.x) {
        FLOAT* r = y + (long long)row * V;
        const long long t = target[row];
        const bool none = t == ignore_index || t < 0 || t >= V;
        const FLOAT z0 = lse[row], a = g_logp[row], b = g_ent[row], k = coef[row];
        for (int c = threadIdx.x; c < V; c += blockDim.x) {
            if (none) { r[c] = 0; continue; }
            const FLOAT v = stats_capped(r[c], cap), w = v * inv_t - z0;
            const FLOAT d = (cap > 0 ? 1 - (v / cap) * (v / cap) : (FLOAT)1) * inv_t;
            r[c] = ((c == t ? a : (FLOAT)0) - exp(w) * (k + b * max2(w, (FLOAT)-1000))) * d;
        }
    }
}
