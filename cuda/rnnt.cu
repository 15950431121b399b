// RNN-T forward-backward over the (T, U+1) lattice, in log space, in any semiring (written by nbs/06_rnnt.ipynb).
#include "rnnt.cuh"

// lse[n] = log sum_v exp(logits[n, v]) for each row n = (b, t, u) inside the lattice (0 elsewhere, or if !fused).
// Stored in float64: a float32 lse of 10 is off by 5e-7, which the gradient's cancellations would amplify.
extern "C" __global__ void rnnt_lse(
    const FLOAT* __restrict__ logits, const long long* __restrict__ logit_lengths,
    const long long* __restrict__ target_lengths, double* __restrict__ lse, int T, int U1, int V, int fused)
{
    __shared__ FLOAT max_slots[32];
    __shared__ double sum_slots[32];
    const long long n = blockIdx.x;
    const int u = (int)(n % U1), t = (int)((n / U1) % T), b = (int)(n / ((long long)U1 * T));
    const bool inside = fused && t < logit_lengths[b] && u <= target_lengths[b];   // the same for the whole block
    const FLOAT* row = logits + n * V;
    FLOAT m = -INFINITY;
    if (inside) for (int v = threadIdx.x; v < V; v += blockDim.x) m = max2(m, row[v]);
    m = block_reduce<true>(m, max_slots);
    double s = 0;
    if (inside && m > -INFINITY) for (int v = threadIdx.x; v < V; v += blockDim.x) s += exp(row[v] - m);
    s = block_reduce<false>(s, sum_slots);
    if (threadIdx.x == 0) lse[n] = !inside ? 0.0 : (m == -INFINITY ? (double)m : m + log(s));
}

// alpha[b, t, u]: semiring sum of the paths from (0, 0) to (t, u); beta[b, t, u]: of the paths from (t, u), its own
// edge included, to the end (label edges with their delay offset). Grid (B, 2): blockIdx.y = 0 computes alpha, 1
// computes beta, one anti-diagonal at a time.
extern "C" __global__ void rnnt_alpha_beta(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    double* __restrict__ alpha, double* __restrict__ beta, double* __restrict__ logz, int T, int U1, int V, int blank,
    double delay_penalty)
{
    const int b = blockIdx.x, Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    const bool fwd = blockIdx.y == 0;
    const long long* y = targets + (long long)b * U1;
    for (int k = 0; k < Tb + Ub; k++) {
        const int d = fwd ? k : Tb + Ub - 1 - k;           // forward: diagonals 0, 1, ...; backward: the reverse
        FOR_EACH_NODE_OF_DIAGONAL(d, t, u) {
            const long long n = node_index(b, t, u, T, U1);
            double v = ZERO;
            const double delay = delay_offset(delay_penalty, t, Tb);
            if (fwd) {
                if (t == 0 && u == 0) v = ONE;
                if (t > 0) v = MUL(alpha[n - U1], edge_lp(logits, lse, n - U1, V, blank));
                if (u > 0) v = SUM(v, MUL(alpha[n - 1], edge_lp(logits, lse, n - 1, V, y[u - 1]) + delay));
                alpha[n] = v;
            } else {
                if (t == Tb - 1 && u == Ub) v = edge_lp(logits, lse, n, V, blank);
                if (t < Tb - 1) v = MUL(beta[n + U1], edge_lp(logits, lse, n, V, blank));
                if (u < Ub) v = SUM(v, MUL(beta[n + 1], edge_lp(logits, lse, n, V, y[u]) + delay));
                beta[n] = v;
            }
        }
        __syncthreads();                                    // the diagonal is written before the next one reads it
    }
    if (fwd && threadIdx.x == 0) {
        const long long n = node_index(b, Tb - 1, Ub, T, U1);
        logz[b] = MUL(alpha[n], edge_lp(logits, lse, n, V, blank));
    }
}

// Posteriors of the blank and the label edge leaving node n = (b, t, u) (Log semiring).
__device__ __forceinline__ void edge_posteriors(
    const FLOAT* logits, const double* lse, const long long* y, const double* alpha, const double* beta, double logz,
    long long n, int t, int u, int Tb, int Ub, int U1, int V, int blank, double delay_penalty, double* pb, double* pe)
{
    const double a = alpha[n] - logz, lpb = edge_lp(logits, lse, n, V, blank);
    *pb = t < Tb - 1 ? exp(a + lpb + beta[n + U1]) : (u == Ub ? exp(a + lpb) : 0.0);
    *pe = u < Ub ? exp(a + (edge_lp(logits, lse, n, V, y[u]) + delay_offset(delay_penalty, t, Tb)) + beta[n + 1]) : 0.0;
}

// grad[row] = g[b] * d(cost_b)/d logits[row], clamped to [-clamp, clamp] before the scaling if clamp > 0, with the
// label edges' posteriors scaled by 1 + fastemit_lambda. One block per row; zeros outside the lattice. exp in FLOAT
// of an argument computed in float64; the cancelling sums in float64, rounded once.
extern "C" __global__ void rnnt_grad(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const double* __restrict__ alpha, const double* __restrict__ beta, const double* __restrict__ costs,
    const FLOAT* __restrict__ g, FLOAT* __restrict__ grad, int T, int U1, int V, int blank, int fused,
    FLOAT clamp, FLOAT fastemit_lambda, double delay_penalty)
{
    const long long n = blockIdx.x;                        // no barrier in this kernel: early exits are safe
    const int u = (int)(n % U1), t = (int)((n / U1) % T), b = (int)(n / ((long long)U1 * T));
    const int Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    FLOAT* out = grad + n * V;
    const double cost = costs[b];
    const FLOAT gb = g[b];
    if (t >= Tb || u > Ub || cost == INFINITY || gb == 0) {   // (a NaN cost gives NaN gradients)
        for (int v = threadIdx.x; v < V; v += blockDim.x) out[v] = 0;
        return;
    }
    const long long* y = targets + (long long)b * U1;
    double pb, pe;
    edge_posteriors(logits, lse, y, alpha, beta, -cost, n, t, u, Tb, Ub, U1, V, blank, delay_penalty, &pb, &pe);
    pe *= 1 + (double)fastemit_lambda;
    const long long label = u < Ub ? y[u] : -1;
    const FLOAT* row = logits + n * V;
    const double l = lse[n], c = clamp;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        double x = fused ? (pb + pe) * (double)exp((FLOAT)(row[v] - l)) : 0.0;
        if (v == blank) x -= pb;
        if (v == label) x -= pe;
        if (c > 0) x = x < -c ? -c : (x > c ? c : x);
        out[v] = (FLOAT)(x * gb);
    }
}

// edges[n, 0:2] = posteriors of the blank and the label edge leaving node n (Log semiring); one thread per node.
extern "C" __global__ void rnnt_edges(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const double* __restrict__ alpha, const double* __restrict__ beta, const double* __restrict__ logz,
    FLOAT* __restrict__ edges, int B, int T, int U1, int V, int blank, double delay_penalty)
{
    const long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= (long long)B * T * U1) return;
    const int u = (int)(n % U1), t = (int)((n / U1) % T), b = (int)(n / ((long long)U1 * T));
    const int Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    double pb = 0, pe = 0;
    if (t < Tb && u <= Ub && !(logz[b] <= -1e30))          // (NaN passes: NaN posteriors)
        edge_posteriors(logits, lse, targets + (long long)b * U1, alpha, beta, logz[b], n, t, u, Tb, Ub, U1, V, blank,
                        delay_penalty, &pb, &pe);
    edges[2 * n] = (FLOAT)pb;
    edges[2 * n + 1] = (FLOAT)pe;
}

// The best path as 0/1 edges (Max semiring): from the last node, follow the predecessor whose score gave alpha
// (the same expressions as rnnt_alpha_beta, so the same comparison). One thread per sequence; edges start zeroed.
extern "C" __global__ void rnnt_backtrack(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const double* __restrict__ alpha, const double* __restrict__ logz, FLOAT* __restrict__ edges,
    int B, int T, int U1, int V, int blank, double delay_penalty)
{
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B || !(logz[b] > -1e30)) return;
    const long long* y = targets + (long long)b * U1;
    const int Tb = (int)logit_lengths[b];
    int t = Tb - 1, u = (int)target_lengths[b];
    edges[2 * node_index(b, t, u, T, U1)] = 1;
    while (t > 0 || u > 0) {
        const long long n = node_index(b, t, u, T, U1);
        double from_blank = t > 0 ? MUL(alpha[n - U1], edge_lp(logits, lse, n - U1, V, blank)) : ZERO;
        double from_emit = u > 0 ? MUL(alpha[n - 1], edge_lp(logits, lse, n - 1, V, y[u - 1]) + delay_offset(delay_penalty, t, Tb))
                                 : ZERO;
        if (u == 0 || (t > 0 && from_blank > from_emit)) {   // alpha = max2(from_blank, from_emit)
            t--; edges[2 * node_index(b, t, u, T, U1)] = 1;
        } else {
            u--; edges[2 * node_index(b, t, u, T, U1) + 1] = 1;
        }
    }
}

// out[i] = row_offset(b[i], t[i], u[i], ...): lets a test check the 64-bit index arithmetic at any size.
extern "C" __global__ void rnnt_row_offsets(
    const int* __restrict__ bs, const int* __restrict__ ts, const int* __restrict__ us, long long* __restrict__ out,
    int n, int T, int U1, int V)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = row_offset(bs[i], ts[i], us[i], T, U1, V);
}
