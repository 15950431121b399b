// The lattice questions over the RNNT lattice (written by nbs/06a_rnnt_questions.ipynb).
#include "rnnt.cuh"

// The lattice questions (seqdist.core's algebras, ALG a macro: ALG_ENTROPY or ALG_KL) over the RNN-T lattice, one
// block per sequence, as the CPU kernel `_rnnt_alg_cpu` computes them. The forward recursion keeps the state (p, q, c)
// of the paths into every node in `fwd` (3, B, T, U+1): node (t, u) sums the blank edge's state from (t-1, u) and the
// label edge's from (t, u-1), one anti-diagonal at a time; out[b] = (log Z_p, log Z_q, accumulator). With `with_grad`
// the backward recursion of the same algebra runs in `bwd` (3, B, T, U+1), and at each node the closed-form gradient
// of the accumulator w.r.t. its two edges' scores goes into `gedge` (4, B, T, U+1: p's blank and label edges, then
// q's), which `rnnt_divergence_grad` turns into gradients w.r.t. the logits. gedge is left as it is (zero) where there
// is no path. Edge scores are the logits minus their row's log-sum-exp (`edge_lp`; lse 0 unless fused). `split` (with
// `with_grad`): block (b, 1) runs the backward recursion at the same time as the forward, and `rnnt_divergence_edges`
// takes the edges' gradients after, a thread a node: the same gedge.
#ifndef ALG
#define ALG 1
#endif
// (The states' helpers alg_load, alg_store, alg_state, alg_times and alg_edge_grad are semiring.cuh's: tdt.cu's
// questions use them too.)
// the scores of node n's blank edge and of its label edge (u < U_b), under p and q (q only for KL)
#define BLANK_P(n) edge_lp(xp, lse_p, n, V, blank)
#define BLANK_Q(n) (ALG == ALG_KL ? edge_lp(xq, lse_q, n, V, blank) : 0.0)
#define LABEL_P(n, u) ((u) < Ub ? edge_lp(xp, lse_p, n, V, y[u]) : -INFINITY)
#define LABEL_Q(n, u) (ALG == ALG_KL && (u) < Ub ? edge_lp(xq, lse_q, n, V, y[u]) : (ALG == ALG_KL ? -INFINITY : 0.0))

// Node n = (b, t, u)'s two out-edges: their scores and their ends' backward states (the end's (0, 0, 0) past the last
// frame at U_b; zero off the lattice).
struct RnntOutEdges { AlgState after_blank, after_label; double bp, bq, ep, eq; };
__device__ __forceinline__ RnntOutEdges rnnt_out_edges(const FLOAT* xp, const FLOAT* xq, const double* lse_p,
    const double* lse_q, const long long* y, const double* bwd, long long nodes, long long n, int t, int u, int Tb,
    int Ub, int U1, int V, int blank) {
    const AlgState zero = alg_state(-INFINITY, -INFINITY, 0.0);
    return {t < Tb - 1 ? alg_load(bwd, nodes, n + U1) : (u == Ub ? alg_state(0.0, 0.0, 0.0) : zero),
            u < Ub ? alg_load(bwd, nodes, n + 1) : zero, BLANK_P(n), BLANK_Q(n), LABEL_P(n, u), LABEL_Q(n, u)};
}
// Their gradients into gedge (4 x nodes: p's blank and label edges, then q's), from the node's forward state f.
__device__ __forceinline__ void rnnt_edge_grads(const RnntOutEdges& o, AlgState f, double zp, double zq, double total,
                                                double* gedge, long long nodes, long long n) {
    alg_edge_grad<ALG>(f, o.bp, o.bq, o.after_blank, zp, zq, total, gedge + n, gedge + 2 * nodes + n);
    alg_edge_grad<ALG>(f, o.ep, o.eq, o.after_label, zp, zq, total, gedge + nodes + n, gedge + 3 * nodes + n);
}
extern "C" __global__ void rnnt_divergence(
    const FLOAT* __restrict__ xp, const FLOAT* __restrict__ xq, const double* __restrict__ lse_p,
    const double* __restrict__ lse_q, const long long* __restrict__ targets, const long long* __restrict__ logit_lengths,
    const long long* __restrict__ target_lengths, double* __restrict__ fwd, double* __restrict__ bwd,
    double* __restrict__ gedge, double* __restrict__ out, int B, int T, int U1, int V, int blank, int with_grad,
    int split)
{
    const int b = blockIdx.x, Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    const long long nodes = (long long)B * T * U1;
    const long long* y = targets + (long long)b * U1;
    const bool kl = ALG == ALG_KL;
    const AlgState zero = alg_state(-INFINITY, -INFINITY, 0.0);
    double zp = 0.0, zq = 0.0, total = 0.0;
    if (blockIdx.y == 0) {                                  // the forward recursion
        for (int d = 0; d < Tb + Ub; d++) {
            FOR_EACH_NODE_OF_DIAGONAL(d, t, u) {
                const long long n = node_index(b, t, u, T, U1);
                AlgState x = alg_state(0.0, 0.0, 0.0);
                if (d > 0) {
                    const AlgState from_blank = t > 0 ? alg_times(alg_load(fwd, nodes, n - U1), BLANK_P(n - U1),
                                                                  BLANK_Q(n - U1)) : zero;
                    const AlgState from_label = u > 0 ? alg_times(alg_load(fwd, nodes, n - 1), LABEL_P(n - 1, u - 1),
                                                                  LABEL_Q(n - 1, u - 1)) : zero;
                    x = alg_plus3<ALG>(from_blank, from_label, zero);
                }
                alg_store(fwd, nodes, n, x);
            }
            __syncthreads();                                // the diagonal is written before the next one reads it
        }
        const long long last = node_index(b, Tb - 1, Ub, T, U1);
        const AlgState fin = alg_load(fwd, nodes, last);
        zp = fin.p + BLANK_P(last); zq = kl ? fin.q + BLANK_Q(last) : zp; total = fin.c;
        if (threadIdx.x == 0) { out[3 * b] = zp; out[3 * b + 1] = zq; out[3 * b + 2] = total; }
        if (!with_grad || split || zp == -INFINITY || zq == -INFINITY) return;   // (the whole block: no barrier
    }                                                                                // is skipped by some only)
    for (int d = Tb + Ub - 1; d >= 0; d--) {                // the backward recursion (fused: the edges' gradients too)
        FOR_EACH_NODE_OF_DIAGONAL(d, t, u) {
            const long long n = node_index(b, t, u, T, U1);
            const RnntOutEdges o = rnnt_out_edges(xp, xq, lse_p, lse_q, y, bwd, nodes, n, t, u, Tb, Ub, U1, V, blank);
            alg_store(bwd, nodes, n, alg_plus3<ALG>(alg_times(o.after_blank, o.bp, o.bq),
                                                    alg_times(o.after_label, o.ep, o.eq), zero));
            if (!split) rnnt_edge_grads(o, alg_load(fwd, nodes, n), zp, zq, total, gedge, nodes, n);
        }
        __syncthreads();
    }
}

// `split`'s edge gradients: thread n of the B T (U+1) nodes, from its forward state and its edges' ends' backward
// states, as the fused kernel's backward writes them (nothing for a sequence with no path, or outside its lattice).
extern "C" __global__ void rnnt_divergence_edges(
    const FLOAT* __restrict__ xp, const FLOAT* __restrict__ xq, const double* __restrict__ lse_p,
    const double* __restrict__ lse_q, const long long* __restrict__ targets, const long long* __restrict__ logit_lengths,
    const long long* __restrict__ target_lengths, const double* __restrict__ fwd, const double* __restrict__ bwd,
    double* __restrict__ gedge, const double* __restrict__ out, int B, int T, int U1, int V, int blank)
{
    const long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x, nodes = (long long)B * T * U1;
    if (n >= nodes) return;
    const LatticeNode x = lattice_node(n, T, U1, logit_lengths, target_lengths, out);
    if (!x.live) return;
    const RnntOutEdges o = rnnt_out_edges(xp, xq, lse_p, lse_q, targets + (long long)x.b * U1, bwd, nodes, n, x.t, x.u,
                                          x.Tb, x.Ub, U1, V, blank);
    rnnt_edge_grads(o, alg_load(fwd, nodes, n), x.zp, x.zq, x.total, gedge, nodes, n);
}
#undef BLANK_P
#undef BLANK_Q
#undef LABEL_P
#undef LABEL_Q

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
        FOR_EACH_NODE_OF_DIAGONAL(d, t, u) {
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
