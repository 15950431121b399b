// Token-and-duration (TDT) and multi-blank transducers: a forward-backward over the (T, U+1) lattice whose edges skip
// frames, in log space, in any semiring (written by nbs/09_tdt.ipynb). A node's edges are rows of a small table:
// (lattice, label?, duration, token column (-1: the target label), duration column (-1: none), first of its column).
#include "tdt.cuh"

// log sum exp of row[lo:hi] (float64), by the whole block (semiring.cuh's block_reduce); -inf for an empty range.
__device__ double row_lse(const FLOAT* row, int lo, int hi, FLOAT* max_slots, double* sum_slots) {
    FLOAT m = -INFINITY;
    for (int v = lo + threadIdx.x; v < hi; v += blockDim.x) m = max2(m, row[v]);
    m = block_reduce<true>(m, max_slots);
    double s = 0;
    if (m > -INFINITY) for (int v = lo + threadIdx.x; v < hi; v += blockDim.x) s += exp((double)row[v] - (double)m);
    s = block_reduce<false>(s, sum_slots);
    return m == -INFINITY ? (double)m : (double)m + log(s);
}

// lse[n] = (token log-sum-exp, duration log-sum-exp) of each row n = (b, t, u) inside the lattice (0 elsewhere).
extern "C" __global__ void tdt_lse(
    const FLOAT* __restrict__ logits, const long long* __restrict__ logit_lengths,
    const long long* __restrict__ target_lengths, double* __restrict__ lse, int T, int U1, int V, int W)
{
    __shared__ FLOAT max_slots[32];
    __shared__ double sum_slots[32];
    const long long n = blockIdx.x;
    const int u = (int)(n % U1), t = (int)((n / U1) % T), b = (int)(n / ((long long)U1 * T));
    const bool inside = t < logit_lengths[b] && u <= target_lengths[b];   // the same for the whole block
    const FLOAT* row = logits + n * W;
    const double lt = row_lse(row, 0, inside ? V : 0, max_slots, sum_slots);
    const double ld = row_lse(row, V, inside ? W : V, max_slots, sum_slots);
    if (threadIdx.x == 0) { lse[2 * n] = inside ? lt : 0.0; lse[2 * n + 1] = inside && W > V ? ld : 0.0; }
}

// beta of the node that edge e leaving (t, u) enters: ONE at the end (Tb, Ub), -inf where it leaves the lattice.
__device__ __forceinline__ double next_beta(const double* beta, const int* e, int b, int t, int u, int Tb, int Ub, int T, int U1) {
    const int tt = t + e[2];
    if (e[1]) return u < Ub && tt < Tb ? beta[node_index(b, tt, u + 1, T, U1)] : -INFINITY;
    if (tt < Tb) return beta[node_index(b, tt, u, T, U1)];
    return tt == Tb && u == Ub ? ONE : -INFINITY;
}

// alpha[l, b, t, u]: semiring sum of the paths of lattice l from (0, 0) to (t, u); beta[l, b, t, u]: of the paths from
// (t, u), its own edge included, to the end. Grid (B, 2L): blockIdx.y = 2l computes alpha, 2l + 1 beta, one
// anti-diagonal at a time; logz[l, b] sums the blanks that land on (Tb, Ub).
extern "C" __global__ void tdt_alpha_beta(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const int* __restrict__ table, int K, double* __restrict__ alpha, double* __restrict__ beta,
    double* __restrict__ logz, int B, int T, int U1, int V, int W, double sigma0, double sigma1, double delay_penalty)
{
    const int b = blockIdx.x, lat = blockIdx.y / 2, Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    const bool fwd = blockIdx.y % 2 == 0;
    const long long* y = targets + (long long)b * U1;
    double* A = alpha + (long long)lat * B * T * U1;
    double* Bt = beta + (long long)lat * B * T * U1;
    for (int k = 0; k < Tb + Ub; k++) {
        const int d = fwd ? k : Tb + Ub - 1 - k;           // forward: diagonals 0, 1, ...; backward: the reverse
        FOR_EACH_NODE_OF_DIAGONAL(d, t, u) {
            const long long n = node_index(b, t, u, T, U1);
            double v = ZERO;
            for (int i = 0; i < K; i++) {
                const int* e = table + 6 * i;
                if (e[0] != lat) continue;
                if (fwd) {                                   // edge e enters (t, u) from (t - d, u - label)
                    const int ts = t - e[2], us = u - e[1];
                    if (ts < 0 || us < 0) continue;
                    const long long m = node_index(b, ts, us, T, U1);
                    v = SUM(v, MUL(A[m], edge_score(logits, lse, y, e, m, ts, us, Tb, V, W, sigma0, sigma1, delay_penalty)));
                } else {
                    const double nb = next_beta(Bt, e, b, t, u, Tb, Ub, T, U1);
                    if (nb == -INFINITY) continue;
                    v = SUM(v, MUL(nb, edge_score(logits, lse, y, e, n, t, u, Tb, V, W, sigma0, sigma1, delay_penalty)));
                }
            }
            if (fwd) A[n] = t == 0 && u == 0 ? ONE : v; else Bt[n] = v;
        }
        __syncthreads();                                    // the diagonal is written before the next one reads it
    }
    if (fwd && threadIdx.x == 0) {
        double z = ZERO;
        for (int i = 0; i < K; i++) {
            const int* e = table + 6 * i;
            if (e[0] != lat || e[1] || Tb - e[2] < 0) continue;
            const long long m = node_index(b, Tb - e[2], Ub, T, U1);
            z = SUM(z, MUL(A[m], edge_score(logits, lse, y, e, m, Tb - e[2], Ub, Tb, V, W, sigma0, sigma1, delay_penalty)));
        }
        logz[lat * B + b] = z;
    }
}

// Posterior of edge e leaving node n = (b, t, u) of its lattice (Log semiring); 0 where it leaves the lattice.
__device__ __forceinline__ double edge_posterior(
    const FLOAT* x, const double* lse, const long long* y, const int* e, const double* alpha, const double* beta,
    const double* logz, long long n, int b, int t, int u, int Tb, int Ub, int B, int T, int U1, int V, int W,
    double sigma0, double sigma1, double delay_penalty)
{
    const long long off = (long long)e[0] * B * T * U1;
    const double nb = next_beta(beta + off, e, b, t, u, Tb, Ub, T, U1);
    if (nb == -INFINITY) return 0.0;
    return exp(alpha[off + n] + edge_score(x, lse, y, e, n, t, u, Tb, V, W, sigma0, sigma1, delay_penalty) + nb
               - logz[e[0] * B + b]);
}

// grad[row] = g[b] * d(cost_b)/d logits[row]: the token part clamped to [-clamp, clamp] before the scaling if
// clamp > 0, the label edges' token part scaled by 1 + fastemit_lambda, lattice l's edges weighted by w_l. One block
// per row; zeros outside the lattice or for an infeasible sequence. exp in FLOAT for the softmax terms; the edges'
// own columns (where terms cancel) again in float64, rounded once.
extern "C" __global__ void tdt_grad(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const int* __restrict__ table, int K, const double* __restrict__ alpha, const double* __restrict__ beta,
    const double* __restrict__ logz, const FLOAT* __restrict__ g, FLOAT* __restrict__ grad, int B, int T, int U1,
    int V, int W, int L, double sigma0, double sigma1, double w0, double w1, double delay_penalty, double clamp,
    double fastemit_lambda)
{
    __shared__ double post[MAX_EDGES];
    const long long n = blockIdx.x;
    const int u = (int)(n % U1), t = (int)((n / U1) % T), b = (int)(n / ((long long)U1 * T));
    const int Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    const long long* y = targets + (long long)b * U1;
    const double gb = (double)g[b];
    bool ok = t < Tb && u <= Ub && gb != 0;                  // the same for the whole block
    for (int l = 0; l < L; l++) ok = ok && !(logz[l * B + b] <= -1e30);     // no path: no gradient (NaN passes)
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        const int* e = table + 6 * k;
        post[k] = ok ? (e[0] ? w1 : w0) * edge_posterior(logits, lse, y, e, alpha, beta, logz, n, b, t, u, Tb, Ub, B, T,
                                                         U1, V, W, sigma0, sigma1, delay_penalty) : 0.0;
    }
    __syncthreads();
    FLOAT* out = grad + n * W;
    if (!ok) { for (int v = threadIdx.x; v < W; v += blockDim.x) out[v] = 0; return; }
    double coef = 0, p_label = 0, occ = 0;
    for (int k = 0; k < K; k++) {
        const int* e = table + 6 * k;
        if (e[1]) p_label += post[k] * (1 + fastemit_lambda); else coef += post[k];
        if (e[4] >= 0) occ += post[k];
    }
    coef += p_label;
    const double s = clamp > 0 ? 1.0 : gb, lt = lse[2 * n], ld = lse[2 * n + 1];
    const FLOAT* row = logits + n * W;
    for (int v = threadIdx.x; v < W; v += blockDim.x) {
        double val;
        if (v < V) {
            val = coef * s * (double)exp((FLOAT)(row[v] - lt));
            if (clamp > 0) val = (val < -clamp ? -clamp : (val > clamp ? clamp : val)) * gb;
        } else {
            double q = 0;
            for (int k = 0; k < K; k++) if (table[6 * k + 4] == v - V) q += post[k];
            val = (occ * (double)exp((FLOAT)(row[v] - ld)) - q) * gb;
        }
        out[v] = (FLOAT)val;
    }
    __syncthreads();                                        // then the edges' token columns, rewritten
    for (int k = threadIdx.x; k <= K; k += blockDim.x) {
        long long c;
        double sub = 0;
        if (k < K) {                                        // the first blank edge of each column: its column
            const int* e = table + 6 * k;
            if (e[1] || !e[5]) continue;
            c = e[3];
            for (int j = k; j < K; j++) if (!table[6 * j + 1] && table[6 * j + 3] == c) sub += post[j];
        } else {                                            // thread K: the target label's column
            if (u >= Ub) continue;
            c = y[u];
            sub = p_label;
        }
        double val = coef * s * exp((double)row[c] - lt) - sub * s;
        if (clamp > 0) val = (val < -clamp ? -clamp : (val > clamp ? clamp : val)) * gb;
        out[c] = (FLOAT)val;
    }
}

// edges[n, k] = the posterior of edge k (of lattice 0) leaving node n; one thread per node.
extern "C" __global__ void tdt_edges(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const int* __restrict__ table, int K, const double* __restrict__ alpha, const double* __restrict__ beta,
    const double* __restrict__ logz, FLOAT* __restrict__ edges, int B, int T, int U1, int V, int W,
    double sigma0, double delay_penalty)
{
    const long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= (long long)B * T * U1) return;
    const int u = (int)(n % U1), t = (int)((n / U1) % T), b = (int)(n / ((long long)U1 * T));
    const int Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    const bool ok = t < Tb && u <= Ub && !(logz[b] <= -1e30);          // (NaN passes: NaN posteriors)
    for (int k = 0; k < K; k++)
        edges[n * K + k] = ok ? (FLOAT)edge_posterior(logits, lse, targets + (long long)b * U1, table + 6 * k, alpha,
                                                      beta, logz, n, b, t, u, Tb, Ub, B, T, U1, V, W, sigma0, 0.0, delay_penalty) : (FLOAT)0;
}

// The best path as 0/1 edges (Max semiring, lattice 0): from the end (Tb, Ub), follow the incoming edge whose score
// gave alpha (the first of equal ones, in table order, as the other backends). One thread per sequence; edges zeroed.
extern "C" __global__ void tdt_backtrack(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const int* __restrict__ table, int K, const double* __restrict__ alpha, const double* __restrict__ logz,
    FLOAT* __restrict__ edges, int B, int T, int U1, int V, int W, double sigma0, double delay_penalty)
{
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B || !(logz[b] > -1e30)) return;
    const long long* y = targets + (long long)b * U1;
    const int Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    int t = Tb, u = Ub;
    while (t > 0 || u > 0) {
        double best = -INFINITY;
        int bk = -1;
        for (int k = 0; k < K; k++) {
            const int* e = table + 6 * k;
            const int ts = t - e[2], us = u - e[1];
            if (e[0] != 0 || ts < 0 || us < 0 || (e[1] && t >= Tb)) continue;
            const long long m = node_index(b, ts, us, T, U1);
            const double v = MUL(alpha[m], edge_score(logits, lse, y, e, m, ts, us, Tb, V, W, sigma0, 0.0, delay_penalty));
            if (v > best) { best = v; bk = k; }
        }
        if (bk < 0) return;                                 // (cannot happen on a feasible lattice)
        t -= table[6 * bk + 2]; u -= table[6 * bk + 1];
        edges[node_index(b, t, u, T, U1) * K + bk] = 1;
    }
}
