// The per-tile reductions of the fused joint + RNN-T loss (written by nbs/06b_joint.ipynb). A tile holds the logits
// z (n, V) of the nodes (t0 + r / uu, u0 + r % uu) of utterance b, r < n; one block per row r, its threads striding
// over the V columns. Macro: FLOAT (float or double).
#include "semiring.cuh"

__device__ __forceinline__ long long joint_node(int b, int t, int u, int T, int U1) {
    return ((long long)b * T + t) * U1 + u;                 // 64-bit: B T (U+1) passes 2^31 / V at training sizes
}

// Logit v of a row: the GEMM's h W^T plus the bias, if any.
__device__ __forceinline__ FLOAT joint_logit(const FLOAT* row, const FLOAT* bias, int has_bias, int v) {
    return has_bias ? row[v] + bias[v] : row[v];
}

// With z[r] = h W^T + bias: lse[node] = log sum_v exp(z[r, v]), and the log-probabilities of the node's blank and
// label edges, edge_lp[node] = (z[r, blank] - lse, z[r, y[b, u]] - lse); y (B, U+1) holds blank past a target's length.
extern "C" __global__ void joint_tile_stats(
    const FLOAT* __restrict__ z, const FLOAT* __restrict__ bias, const long long* __restrict__ targets,
    double* __restrict__ lse, double* __restrict__ edge_lp, int has_bias, int b, int t0, int u0, int uu, int T, int U1,
    int V, int blank)
{
    __shared__ FLOAT max_slots[32];
    __shared__ double sum_slots[32];
    const int r = blockIdx.x, t = t0 + r / uu, u = u0 + r % uu;
    const FLOAT* row = z + (long long)r * V;
    FLOAT m = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) m = max2(m, joint_logit(row, bias, has_bias, v));
    m = block_reduce<true>(m, max_slots);
    double s = 0;
    if (m > -INFINITY) for (int v = threadIdx.x; v < V; v += blockDim.x) s += exp(joint_logit(row, bias, has_bias, v) - m);
    s = block_reduce<false>(s, sum_slots);
    if (threadIdx.x == 0) {
        const long long n = joint_node(b, t, u, T, U1);
        const double l = m == -INFINITY ? (double)m : m + log(s);
        lse[n] = l;
        edge_lp[2 * n] = joint_logit(row, bias, has_bias, blank) - l;
        edge_lp[2 * n + 1] = joint_logit(row, bias, has_bias, (int)targets[(long long)b * U1 + u]) - l;
    }
}

// z[r] (+ bias) becomes g[b] * d cost_b / dz[r] = g_b ((pb + pe) softmax - pb [blank] - pe [label]), clamped to
// [-clamp, clamp] before the scaling if clamp > 0, pe scaled by 1 + lam (FastEmit); zeros outside the lattice.
// post (B, T, U+1, 2): the edges' posteriors. Each thread reads and writes its own columns: in place is safe.
extern "C" __global__ void joint_tile_grad(
    FLOAT* __restrict__ z, const FLOAT* __restrict__ bias, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const double* __restrict__ lse, const double* __restrict__ post, const double* __restrict__ g, int has_bias, int b,
    int t0, int u0, int uu, int T, int U1, int V, int blank, double clamp, double lam)
{
    const int r = blockIdx.x, t = t0 + r / uu, u = u0 + r % uu;   // no barrier in this kernel: early exits are safe
    FLOAT* row = z + (long long)r * V;
    const int Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    if (t >= Tb || u > Ub) {
        for (int v = threadIdx.x; v < V; v += blockDim.x) row[v] = 0;
        return;
    }
    const long long n = joint_node(b, t, u, T, U1);
    const double pb = post[2 * n], pe = post[2 * n + 1] * (1 + lam), l = lse[n], gb = g[b];
    const long long label = u < Ub ? targets[(long long)b * U1 + u] : -1;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        double x = (pb + pe) * (double)exp((FLOAT)(joint_logit(row, bias, has_bias, v) - l));
        if (v == blank) x -= pb;
        if (v == label) x -= pe;
        if (clamp > 0) x = x < -clamp ? -clamp : (x > clamp ? clamp : x);
        row[v] = (FLOAT)(x * gb);
    }
}
