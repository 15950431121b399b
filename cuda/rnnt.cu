// RNN-T forward-backward over the (T, U+1) lattice, in log space, in any semiring (written by nbs/06_rnnt.ipynb).
#include "semiring.cuh"

// Offsets are 64-bit: B * T * (U+1) * V passes 2^31 at the sizes people train with.
__device__ __forceinline__ long long node_index(int b, int t, int u, int T, int U1) {
    return ((long long)b * T + t) * U1 + u;
}
__device__ __forceinline__ long long row_offset(int b, int t, int u, int T, int U1, int V) {
    return node_index(b, t, u, T, U1) * (long long)V;
}

// Log-probability of label k at node n: logits minus the row's log-sum-exp (0 if the logits are log-probs already).
__device__ __forceinline__ double edge_lp(const FLOAT* logits, const double* lse, long long n, int V, long long k) {
    return logits[n * V + k] - lse[n];
}

// k2's delay penalty: the offset added to the log-probability of the label edges of frame t (Tb frames in all).
__device__ __forceinline__ double delay_offset(double delay_penalty, int t, int Tb) {
    return delay_penalty * (0.5 * (Tb - 1) - t);
}

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
        for (int u = threadIdx.x; u <= Ub; u += blockDim.x) {
            const int t = d - u;
            if (t < 0 || t >= Tb) continue;
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
// The lattice questions (seqdist.core's algebras, ALG a macro: ALG_ENTROPY or ALG_KL) over the RNN-T lattice, one
// block per sequence, as the CPU kernel `_rnnt_alg_cpu` computes them. The forward recursion keeps the state (p, q, c)
// of the paths into every node in `fwd` (3, B, T, U+1): node (t, u) sums the blank edge's state from (t-1, u) and the
// label edge's from (t, u-1), one anti-diagonal at a time; out[b] = (log Z_p, log Z_q, accumulator). With `with_grad`
// the backward recursion of the same algebra runs in `bwd` (3, B, T, U+1), and at each node the closed-form gradient
// of the accumulator w.r.t. its two edges' scores goes into `gedge` (4, B, T, U+1: p's blank and label edges, then
// q's), which `rnnt_divergence_grad` turns into gradients w.r.t. the logits. gedge is left as it is (zero) where there
// is no path. Edge scores are the logits minus their row's log-sum-exp (`edge_lp`; lse 0 unless fused).
#ifndef ALG
#define ALG 1
#endif
// (The states' helpers alg_load, alg_store, alg_state, alg_times and alg_edge_grad are semiring.cuh's: tdt.cu's
// questions use them too.)
extern "C" __global__ void rnnt_divergence(
    const FLOAT* __restrict__ xp, const FLOAT* __restrict__ xq, const double* __restrict__ lse_p,
    const double* __restrict__ lse_q, const long long* __restrict__ targets, const long long* __restrict__ logit_lengths,
    const long long* __restrict__ target_lengths, double* __restrict__ fwd, double* __restrict__ bwd,
    double* __restrict__ gedge, double* __restrict__ out, int B, int T, int U1, int V, int blank, int with_grad)
{
    const int b = blockIdx.x, Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    const long long nodes = (long long)B * T * U1;
    const long long* y = targets + (long long)b * U1;
    const bool kl = ALG == ALG_KL;
    const AlgState zero = alg_state(-INFINITY, -INFINITY, 0.0);
    // the scores of node n's blank edge and of its label edge (u < U_b), under p and q (q only for KL)
    #define BLANK_P(n) edge_lp(xp, lse_p, n, V, blank)
    #define BLANK_Q(n) (kl ? edge_lp(xq, lse_q, n, V, blank) : 0.0)
    #define LABEL_P(n, u) ((u) < Ub ? edge_lp(xp, lse_p, n, V, y[u]) : -INFINITY)
    #define LABEL_Q(n, u) (kl && (u) < Ub ? edge_lp(xq, lse_q, n, V, y[u]) : (kl ? -INFINITY : 0.0))
    for (int d = 0; d < Tb + Ub; d++) {
        for (int u = threadIdx.x; u <= Ub; u += blockDim.x) {
            const int t = d - u;
            if (t < 0 || t >= Tb) continue;
            const long long n = node_index(b, t, u, T, U1);
            AlgState x = alg_state(0.0, 0.0, 0.0);
            if (d > 0) {
                const AlgState from_blank = t > 0 ? alg_times(alg_load(fwd, nodes, n - U1), BLANK_P(n - U1), BLANK_Q(n - U1)) : zero;
                const AlgState from_label = u > 0 ? alg_times(alg_load(fwd, nodes, n - 1), LABEL_P(n - 1, u - 1), LABEL_Q(n - 1, u - 1)) : zero;
                x = alg_plus3<ALG>(from_blank, from_label, zero);
            }
            alg_store(fwd, nodes, n, x);
        }
        __syncthreads();                                    // the diagonal is written before the next one reads it
    }
    const long long last = node_index(b, Tb - 1, Ub, T, U1);
    const AlgState fin = alg_load(fwd, nodes, last);
    const double zp = fin.p + BLANK_P(last), zq = kl ? fin.q + BLANK_Q(last) : zp, total = fin.c;
    if (threadIdx.x == 0) { out[3 * b] = zp; out[3 * b + 1] = zq; out[3 * b + 2] = total; }
    if (!with_grad || zp == -INFINITY || zq == -INFINITY) return;     // (the whole block: no barrier is skipped by some)
    for (int d = Tb + Ub - 1; d >= 0; d--) {
        for (int u = threadIdx.x; u <= Ub; u += blockDim.x) {
            const int t = d - u;
            if (t < 0 || t >= Tb) continue;
            const long long n = node_index(b, t, u, T, U1);
            const AlgState after_blank = t < Tb - 1 ? alg_load(bwd, nodes, n + U1)
                                                    : (u == Ub ? alg_state(0.0, 0.0, 0.0) : zero);
            const AlgState after_label = u < Ub ? alg_load(bwd, nodes, n + 1) : zero;
            const double bp = BLANK_P(n), bq = BLANK_Q(n), ep = LABEL_P(n, u), eq = LABEL_Q(n, u);
            alg_store(bwd, nodes, n, alg_plus3<ALG>(alg_times(after_blank, bp, bq), alg_times(after_label, ep, eq), zero));
            const AlgState f = alg_load(fwd, nodes, n);
            alg_edge_grad<ALG>(f, bp, bq, after_blank, zp, zq, total, gedge + n, gedge + 2 * nodes + n);
            alg_edge_grad<ALG>(f, ep, eq, after_label, zp, zq, total, gedge + nodes + n, gedge + 3 * nodes + n);
        }
        __syncthreads();
    }
    #undef BLANK_P
    #undef BLANK_Q
    #undef LABEL_P
    #undef LABEL_Q
}

// grad[row] = the gradient w.r.t. the logits of row n = (b, t, u), from the gradients gb, ge w.r.t. its blank and label
// edges' scores (`rnnt_divergence`'s gedge): with the log-softmax (fused), -(gb + ge) softmax + gb at the blank + ge at
// the label; without, gb and ge alone. One block per row; zeros outside the lattice. In float64, rounded once.
extern "C" __global__ void rnnt_divergence_grad(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const double* __restrict__ gb, const double* __restrict__ ge, FLOAT* __restrict__ grad, int T, int U1, int V,
    int blank, int fused)
{
    const long long n = blockIdx.x;                        // no barrier in this kernel: early exits are safe
    const int u = (int)(n % U1), t = (int)((n / U1) % T), b = (int)(n / ((long long)U1 * T));
    const int Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    FLOAT* row_out = grad + n * V;
    if (t >= Tb || u > Ub) {
        for (int v = threadIdx.x; v < V; v += blockDim.x) row_out[v] = 0;
        return;
    }
    const double g_b = gb[n], g_e = u < Ub ? ge[n] : 0.0, w = g_b + g_e, l = lse[n];
    const long long label = u < Ub ? targets[(long long)b * U1 + u] : -1;
    const FLOAT* row = logits + n * V;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        double x = fused ? -w * exp((double)row[v] - l) : 0.0;
        if (v == blank) x += g_b;
        if (v == label) x += g_e;
        row_out[v] = (FLOAT)x;
    }
}

// Backward sampling over the loss's forward (`rnnt_alpha_beta`'s alpha, Log): thread i * B + b walks sample i of
// sequence b back from (T_b-1, U_b), and from a node (t, j) on the anti-diagonal d = t + j steps to (t-1, j) by a blank
// or to (t, j-1) by label j, in proportion to the predecessor's alpha times the edge, picked by u[i, b, d-1]
// (`pick_log3`): the CPU kernel's candidates in its order, so the same uniforms give the same samples. Label j's frame
// goes in frames[i, b, j-1] and the sample's summed edge log-probabilities in score[i, b]; nothing is written for a
// sequence without an alignment (log Z -inf).
extern "C" __global__ void rnnt_sample(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const double* __restrict__ alpha, const double* __restrict__ logz, const double* __restrict__ u,
    long long* __restrict__ frames, double* __restrict__ score, int n_samples, int B, int T, int U1, int V, int blank)
{
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)n_samples * B) return;
    const int b = (int)(id % B);
    if (!(logz[b] > -INFINITY)) return;
    const long long* y = targets + (long long)b * U1;
    const double* ui = u + id * (T + U1 - 2);                          // u[i, b, :]
    long long* fi = frames + id * (U1 - 1);
    int t = (int)logit_lengths[b] - 1, j = (int)target_lengths[b];
    double path = edge_lp(logits, lse, node_index(b, t, j, T, U1), V, blank);     // the final blank
    while (t + j > 0) {
        const long long n = node_index(b, t, j, T, U1);
        const double e0 = t > 0 ? edge_lp(logits, lse, n - U1, V, blank) : -INFINITY;
        const double e1 = j > 0 ? edge_lp(logits, lse, n - 1, V, y[j - 1]) : -INFINITY;
        const bool label = t == 0 || (j > 0 && pick_log3(alpha[n - U1] + e0, alpha[n - 1] + e1, -INFINITY, ui[t + j - 1]) == 1);
        if (label) { fi[j - 1] = t; j--; path += e1; }
        else { t--; path += e0; }
    }
    score[id] = path;
}

// The k best alignments (KMax(k), k <= 16), one block per sequence, as the CPU kernel `_rnnt_kbest_cpu`: each node
// keeps the k best scores into it, sorted (`vals`, B x T x (U+1) x k), merged from the blank edge's and the label edge's
// predecessor (`merge_top2_plus`, ties to the blank's), and for each (node, rank) the code 16 * list + rank of where it came
// from (`back`, int8, the same shape); one anti-diagonal at a time. Then thread r < k walks rank r back from
// (T_b-1, U_b): frames[r, b, j] gets label j's frame and best[r, b] the path's score (-inf, frames as they are, where
// fewer than r + 1 paths exist).
// `merge_top3` of the blank edge's list a + ea and the label edge's b + eb (no third list): the same order and codes,
// each candidate's edge added as it is read (no copies of the lists: a thread's arrays would live in local memory).
__device__ void merge_top2_plus(int k, const double* a, double ea, const double* b, double eb, double* out,
                                signed char* code) {
    int i = 0, j = 0;
    for (int r = 0; r < k; r++) {
        const double va = i < k ? a[i] + ea : -INFINITY, vb = j < k ? b[j] + eb : -INFINITY;
        if (va >= vb) { out[r] = va; code[r] = (signed char)i; i++; }
        else { out[r] = vb; code[r] = (signed char)(16 + j); j++; }
    }
}

extern "C" __global__ void rnnt_kbest(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths, double* __restrict__ vals,
    signed char* __restrict__ back, double* __restrict__ best, long long* __restrict__ frames, int B, int T, int U1,
    int V, int blank, int k)
{
    const int b = blockIdx.x, Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    const long long* y = targets + (long long)b * U1;
    __shared__ double none[16];
    if (threadIdx.x < 16) none[threadIdx.x] = -INFINITY;
    for (int r = threadIdx.x; r < k; r += blockDim.x) best[(long long)r * B + b] = -INFINITY;
    for (int d = 0; d < Tb + Ub; d++) {
        __syncthreads();                                    // the previous diagonal (and `none`) are written
        for (int u = threadIdx.x; u <= Ub; u += blockDim.x) {
            const int t = d - u;
            if (t < 0 || t >= Tb) continue;
            const long long n = node_index(b, t, u, T, U1);
            double* o = vals + n * k;
            if (d == 0) { o[0] = 0.0; for (int r = 1; r < k; r++) o[r] = -INFINITY; continue; }
            merge_top2_plus(k, t > 0 ? vals + (n - U1) * k : none, t > 0 ? edge_lp(logits, lse, n - U1, V, blank) : 0.0,
                            u > 0 ? vals + (n - 1) * k : none, u > 0 ? edge_lp(logits, lse, n - 1, V, y[u - 1]) : 0.0,
                            o, back + n * k);
        }
    }
    __syncthreads();
    const int r = threadIdx.x;
    const long long last = node_index(b, Tb - 1, Ub, T, U1);
    if (r >= k) return;
    const double s = vals[last * k + r] + edge_lp(logits, lse, last, V, blank);
    if (!(s > -INFINITY)) return;
    best[(long long)r * B + b] = s;
    long long* fr = frames + ((long long)r * B + b) * (U1 - 1);
    int t = Tb - 1, j = Ub, rank = r;
    while (t + j > 0) {
        const int c = back[node_index(b, t, j, T, U1) * k + rank];
        if (c >= 16) { fr[j - 1] = t; j--; } else t--;
        rank = c % 16;
    }
}
