// The lattice questions over the TDT lattice (written by nbs/09b_tdt_questions.ipynb).
#include "tdt.cuh"


// ---- the lattice questions (entropy, KL) on the TDT and multi-blank lattices, as rnnt_divergence on the RNN-T's ----
// One block per sequence: the algebra's forward recursion into `fwd` (3, B, T, U+1), node (t, u) the sum over the table's
// edge kinds k entering it from (t - d_k, u - label_k) of that node's state times the edge, folded two at a time onto the
// zero state as the CPU kernel's `_fold` folds them; out[b] = (log Z_p, log Z_q, accumulator), the blanks that land on
// (T_b, U_b). With `with_grad` the backward recursion runs in `bwd` (3, B, T, U+1), and at each node the closed-form
// gradient of the accumulator w.r.t. each of its edges' scores goes into `gedge` (2, K, B, T, U+1: p's, then q's), 0 for
// an edge that leaves the lattice; `tdt_divergence_grad` turns them into gradients w.r.t. the logits. gedge is left as
// it is (zero) for a sequence with no path. Edge scores are `edge_score`'s with the question's sigma, no delay offset.
// `split` (with `with_grad`): block (b, 1) runs the backward recursion at the same time as the forward (the states
// alone), and `tdt_divergence_edges` takes the edges' gradients after, a thread a node: the same gedge.
#ifndef ALG
#define ALG 1
#endif

// acc (+)= x, two terms at a time: `pend` holds an odd one until its partner comes (`has`), as `_fold` pairs them
__device__ __forceinline__ void alg_fold(AlgState& acc, AlgState& pend, bool& has, AlgState x) {
    if (has) acc = alg_plus3<ALG>(acc, pend, x); else pend = x;
    has = !has;
}
#define SCORE_P(e, m, t, u) edge_score(xp, lse_p, y, e, m, t, u, Tb, V, W, sigma, 0.0, 0.0)
#define SCORE_Q(e, m, t, u) (ALG == ALG_KL ? edge_score(xq, lse_q, y, e, m, t, u, Tb, V, W, sigma, 0.0, 0.0) : 0.0)

// Node n = (b, t, u)'s out-edges: its backward state (their ends' states times the edges, folded as `_fold` folds them)
// and, with `grads`, each edge's gradient (`alg_edge_grad`, from the node's forward state f) into gedge, 0 for an edge
// that leaves the lattice.
__device__ __forceinline__ AlgState tdt_out_edges(
    const FLOAT* xp, const FLOAT* xq, const double* lse_p, const double* lse_q, const long long* y, const int* table,
    int K, const double* bwd, double* gedge, long long nodes, int b, int t, int u, int Tb, int Ub, int T, int U1, int V,
    int W, double sigma, bool grads, AlgState f, double zp, double zq, double total)
{
    const AlgState zero = alg_state(-INFINITY, -INFINITY, 0.0);
    const long long n = node_index(b, t, u, T, U1);
    AlgState acc = zero, pend = zero;
    bool has = false;
    for (int k = 0; k < K; k++) {                           // edge k leaves (t, u) for (t + d_k, u + label_k)
        const int* e = table + 6 * k;
        const int tt = t + e[2], uu = u + e[1];
        double* gp = gedge + k * nodes + n;
        double* gq = gedge + (K + k) * nodes + n;
        AlgState w;
        if (uu <= Ub && tt < Tb) w = alg_load(bwd, nodes, node_index(b, tt, uu, T, U1));
        else if (!e[1] && tt == Tb && u == Ub) w = alg_state(0.0, 0.0, 0.0);     // onto the end
        else { if (grads) { *gp = 0.0; *gq = 0.0; } continue; }
        const double sp = SCORE_P(e, n, t, u), sq = SCORE_Q(e, n, t, u);
        if (grads) alg_edge_grad<ALG>(f, sp, sq, w, zp, zq, total, gp, gq);
        alg_fold(acc, pend, has, alg_times(w, sp, sq));
    }
    if (has) acc = alg_plus3<ALG>(acc, pend, zero);
    return acc;
}

extern "C" __global__ void tdt_divergence(
    const FLOAT* __restrict__ xp, const FLOAT* __restrict__ xq, const double* __restrict__ lse_p,
    const double* __restrict__ lse_q, const long long* __restrict__ targets, const long long* __restrict__ logit_lengths,
    const long long* __restrict__ target_lengths, const int* __restrict__ table, int K, double* __restrict__ fwd,
    double* __restrict__ bwd, double* __restrict__ gedge, double* __restrict__ out, int B, int T, int U1, int V, int W,
    double sigma, int with_grad, int split)
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
                AlgState acc = d == 0 ? alg_state(0.0, 0.0, 0.0) : zero, pend = zero;
                bool has = false;
                for (int k = 0; d > 0 && k < K; k++) {      // edge k enters (t, u) from (t - d_k, u - label_k)
                    const int* e = table + 6 * k;
                    const int ts = t - e[2], us = u - e[1];
                    if (ts < 0 || us < 0) continue;
                    const long long m = node_index(b, ts, us, T, U1);
                    alg_fold(acc, pend, has,
                             alg_times(alg_load(fwd, nodes, m), SCORE_P(e, m, ts, us), SCORE_Q(e, m, ts, us)));
                }
                if (has) acc = alg_plus3<ALG>(acc, pend, zero);
                alg_store(fwd, nodes, node_index(b, t, u, T, U1), acc);
            }
            __syncthreads();                                // the diagonal is written before a later one reads it
        }
        AlgState fin = zero, pend = zero;                   // every thread folds the final blanks alike
        bool has = false;
        for (int k = 0; k < K; k++) {
            const int* e = table + 6 * k;
            const int s = Tb - e[2];
            if (e[1] || s < 0) continue;
            const long long m = node_index(b, s, Ub, T, U1);
            alg_fold(fin, pend, has,
                     alg_times(alg_load(fwd, nodes, m), SCORE_P(e, m, s, Ub), SCORE_Q(e, m, s, Ub)));
        }
        if (has) fin = alg_plus3<ALG>(fin, pend, zero);
        zp = fin.p; zq = kl ? fin.q : zp; total = fin.c;
        if (threadIdx.x == 0) { out[3 * b] = zp; out[3 * b + 1] = zq; out[3 * b + 2] = total; }
        if (!with_grad || split || zp == -INFINITY || zq == -INFINITY) return;   // (the whole block: no barrier
    }                                                                                // is skipped by some only)
    for (int d = Tb + Ub - 1; d >= 0; d--) {                // the backward recursion (fused: the edges' gradients too)
        FOR_EACH_NODE_OF_DIAGONAL(d, t, u) {
            const long long n = node_index(b, t, u, T, U1);
            const AlgState f = split ? zero : alg_load(fwd, nodes, n);      // (split: the forward's, being written)
            alg_store(bwd, nodes, n, tdt_out_edges(xp, xq, lse_p, lse_q, y, table, K, bwd, gedge, nodes, b, t, u, Tb,
                                                   Ub, T, U1, V, W, sigma, !split, f, zp, zq, total));
        }
        __syncthreads();
    }
}

// `split`'s edge gradients: thread n of the B T (U+1) nodes, from its forward state and its edges' ends' backward
// states, as the fused kernel's backward writes them (nothing for a sequence with no path, or outside its lattice).
extern "C" __global__ void tdt_divergence_edges(
    const FLOAT* __restrict__ xp, const FLOAT* __restrict__ xq, const double* __restrict__ lse_p,
    const double* __restrict__ lse_q, const long long* __restrict__ targets, const long long* __restrict__ logit_lengths,
    const long long* __restrict__ target_lengths, const int* __restrict__ table, int K, const double* __restrict__ fwd,
    const double* __restrict__ bwd, const double* __restrict__ out, double* __restrict__ gedge, int B, int T, int U1,
    int V, int W, double sigma)
{
    const long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x, nodes = (long long)B * T * U1;
    if (n >= nodes) return;
    const LatticeNode x = lattice_node(n, T, U1, logit_lengths, target_lengths, out);
    if (!x.live) return;
    tdt_out_edges(xp, xq, lse_p, lse_q, targets + (long long)x.b * U1, table, K, bwd, gedge, nodes, x.b, x.t, x.u, x.Tb,
                  x.Ub, T, U1, V, W, sigma, true, alg_load(fwd, nodes, n), x.zp, x.zq, x.total);
}
#undef SCORE_P
#undef SCORE_Q

// grad[row] = the gradient w.r.t. the logits of row n = (b, t, u) from the gradients g_k w.r.t. its edges' scores
// (`tdt_divergence`'s gedge, one side): an edge's score is its token's log-softmax plus its duration's, so token v gets
// (the g_k of the edges whose token is v) - (sum of all g_k) softmax_v and duration i gets (the g_k of the edges of
// duration i) - (the sum over edges with a duration) softmax_i. One block per row; zeros outside the lattice. In
// float64, rounded once.
extern "C" __global__ void tdt_divergence_grad(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const int* __restrict__ table, int K, const double* __restrict__ gedge, FLOAT* __restrict__ grad, int B, int T,
    int U1, int V, int W)
{
    __shared__ double g[MAX_EDGES];
    const long long n = blockIdx.x, nodes = (long long)B * T * U1;
    const int u = (int)(n % U1), t = (int)((n / U1) % T), b = (int)(n / ((long long)U1 * T));
    const int Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    const bool inside = t < Tb && u <= Ub;                  // the same for the whole block
    for (int k = threadIdx.x; k < K; k += blockDim.x) g[k] = inside ? gedge[k * nodes + n] : 0.0;
    __syncthreads();
    FLOAT* out = grad + n * W;
    if (!inside) { for (int v = threadIdx.x; v < W; v += blockDim.x) out[v] = 0; return; }
    double gsum = 0, glabel = 0, gdur = 0;
    for (int k = 0; k < K; k++) {
        gsum += g[k];
        if (table[6 * k + 1]) glabel += g[k];
        if (table[6 * k + 4] >= 0) gdur += g[k];
    }
    const long long label = u < Ub ? targets[(long long)b * U1 + u] : -1;
    const double lt = lse[2 * n], ld = lse[2 * n + 1];
    const FLOAT* row = logits + n * W;
    for (int v = threadIdx.x; v < W; v += blockDim.x) {
        double own = 0;
        if (v < V) {
            for (int k = 0; k < K; k++) if (!table[6 * k + 1] && table[6 * k + 3] == v) own += g[k];
            if (v == label) own += glabel;
            out[v] = (FLOAT)(own - gsum * exp((double)row[v] - lt));
        } else {
            for (int k = 0; k < K; k++) if (table[6 * k + 4] == v - V) own += g[k];
            out[v] = (FLOAT)(own - gdur * exp((double)row[v] - ld));
        }
    }
}

// The log-weight with which edge kind k enters (t, j) of sequence b's lattice: alpha at its start plus its score; -inf
// if it cannot enter (its start outside the lattice, or a label at the end T_b).
__device__ __forceinline__ double enter_weight(const FLOAT* logits, const double* lse, const long long* y, const int* table,
    int k, const double* alpha, int b, int t, int j, int Tb, int T, int U1, int V, int W, double sigma)
{
    const int* e = table + 6 * k;
    const int ts = t - e[2], us = j - e[1];
    if (ts < 0 || us < 0 || (e[1] && t >= Tb)) return -INFINITY;
    const long long m = node_index(b, ts, us, T, U1);
    return alpha[m] + edge_score(logits, lse, y, e, m, ts, us, Tb, V, W, sigma, 0.0, 0.0);
}
struct TdtEnterWeights {  // `enter_weight` of each edge kind k into (t, j), for `choose_log`
    const FLOAT* logits; const double* lse; const long long* y; const int* table; const double* alpha;
    int b, t, j, Tb, T, U1, V, W; double sigma;
    __device__ double operator()(int k) const { return enter_weight(logits, lse, y, table, k, alpha, b, t, j, Tb, T, U1, V, W, sigma); }
};

// Backward sampling over the loss's forward (`tdt_alpha_beta`'s alpha, Log): thread i * B + b walks sample i of
// sequence b back from the end (T_b, U_b), at step s entering its node by the edge kind that `_choose` draws from the
// weights `enter_weight` with the uniform u[i, b, s] (the CPU kernel's candidates and arithmetic, in three passes over
// the kinds: no per-thread arrays, semiring.cuh's `choose_log`), so the same uniforms give the same samples. The edges taken go to
// taken[:, i, b, s] = (start t, start u, kind) and the path's summed edge scores to score[i, b]; nothing is written for
// a sequence without a path (log Z at the semiring's zero).
extern "C" __global__ void tdt_sample(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const int* __restrict__ table, int K, const double* __restrict__ alpha, const double* __restrict__ logz,
    const double* __restrict__ u, long long* __restrict__ taken, double* __restrict__ score, int n_samples, int B,
    int T, int U1, int V, int W, int steps, double sigma)
{
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)n_samples * B) return;
    const int b = (int)(id % B), Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    if (logz[b] <= -1e30) return;
    const long long* y = targets + (long long)b * U1;
    const long long plane = (long long)n_samples * B * steps;
    const double* ui = u + id * steps;
    long long* tk = taken + id * steps;
    int t = Tb, j = Ub, s = 0;
    double path = 0.0;
    while (t > 0 || j > 0) {
        const TdtEnterWeights w = {logits, lse, y, table, alpha, b, t, j, Tb, T, U1, V, W, sigma};
        const int k = choose_log(w, K, ui[s]);
        const int* e = table + 6 * k;
        t -= e[2]; j -= e[1];
        path += edge_score(logits, lse, y, e, node_index(b, t, j, T, U1), t, j, Tb, V, W, sigma, 0.0, 0.0);
        tk[s] = t; tk[plane + s] = j; tk[2 * plane + s] = k;
        s++;
    }
    score[id] = path;
}

// The k best paths (KMax(k), k <= 16), one block per sequence, as the CPU kernel `_tdt_kbest_cpu`: each node keeps the
// k best scores into it, sorted (`vals`, B x T x U1 x k), and for each rank the edge kind and the rank at its start it
// came from (`kinds`, `ranks`, int8, the same shape); one anti-diagonal at a time. A node takes its K kinds' lists (the
// start's list plus the edge's score) by a K-way merge, rank by rank the largest head, ties to the lower kind and then
// the lower rank: the order `_kmax_node` gets by folding the kinds two at a time with `merge_top3`. A thread's edge
// scores and list heads live in `scores` and `heads` (B x blockDim x K, global memory: a thread's arrays would be local
// memory). Then thread r < k walks rank r back from the end: taken[:, r, b, s] = (start t, start u, kind) of its s-th
// edge from the end and best[r, b] its score (-inf, taken as it is, where fewer than r + 1 paths exist).
__device__ void tdt_kmax(int k, int K, const int* __restrict__ table, const double* __restrict__ vals, int b, int t, int u,
                         int T, int U1, const double* sc, unsigned char* head, double* out, signed char* kind,
                         signed char* rank) {
    for (int r = 0; r < k; r++) {
        double top = -INFINITY;
        int pick = -1;
        for (int i = 0; i < K; i++) {
            if (head[i] >= k) continue;                     // no edge of this kind, or its list taken
            const int* e = table + 6 * i;
            const double v = vals[node_index(b, t - e[2], u - e[1], T, U1) * k + head[i]] + sc[i];
            if (pick < 0 || v > top) { top = v; pick = i; }
        }
        out[r] = top;
        kind[r] = (signed char)(pick < 0 ? 0 : pick);
        rank[r] = (signed char)(pick < 0 ? 0 : head[pick]);
        if (pick >= 0) head[pick]++;
    }
}

extern "C" __global__ void tdt_kbest(
    const FLOAT* __restrict__ logits, const double* __restrict__ lse, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const int* __restrict__ table, int K, double* __restrict__ vals, signed char* __restrict__ kinds,
    signed char* __restrict__ ranks, double* __restrict__ scores, unsigned char* __restrict__ heads,
    double* __restrict__ best, long long* __restrict__ taken, int B, int T, int U1, int V, int W, int k, int steps,
    double sigma)
{
    const int b = blockIdx.x, Tb = (int)logit_lengths[b], Ub = (int)target_lengths[b];
    const long long* y = targets + (long long)b * U1;
    double* sc = scores + ((long long)b * blockDim.x + threadIdx.x) * K;
    unsigned char* head = heads + ((long long)b * blockDim.x + threadIdx.x) * K;
    __shared__ double fin[16];
    __shared__ signed char fin_kind[16], fin_rank[16];
    for (int r = threadIdx.x; r < k; r += blockDim.x) best[(long long)r * B + b] = -INFINITY;
    for (int d = 0; d < Tb + Ub; d++) {
        __syncthreads();                                    // the earlier diagonals are written
        FOR_EACH_NODE_OF_DIAGONAL(d, t, u) {
            const long long n = node_index(b, t, u, T, U1);
            for (int i = 0; i < K; i++) {                   // edge kind i enters (t, u) from (t - d_i, u - label_i)
                const int* e = table + 6 * i;
                const int ts = t - e[2], us = u - e[1];
                head[i] = d > 0 && ts >= 0 && us >= 0 ? 0 : k;
                if (head[i] == 0) sc[i] = edge_score(logits, lse, y, e, node_index(b, ts, us, T, U1), ts, us, Tb, V, W,
                                                     sigma, 0.0, 0.0);
            }
            tdt_kmax(k, K, table, vals, b, t, u, T, U1, sc, head, vals + n * k, kinds + n * k, ranks + n * k);
            if (d == 0) vals[n * k] = 0.0;                  // the start: the empty path
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {                                 // into the end: the blanks that land on frame Tb at Ub
        for (int i = 0; i < K; i++) {
            const int* e = table + 6 * i;
            const int ts = Tb - e[2];
            head[i] = !e[1] && ts >= 0 ? 0 : k;
            if (head[i] == 0) sc[i] = edge_score(logits, lse, y, e, node_index(b, ts, Ub, T, U1), ts, Ub, Tb, V, W, sigma,
                                                 0.0, 0.0);
        }
        tdt_kmax(k, K, table, vals, b, Tb, Ub, T, U1, sc, head, fin, fin_kind, fin_rank);
    }
    __syncthreads();
    const int r = threadIdx.x;
    if (r >= k || !(fin[r] > -INFINITY)) return;
    best[(long long)r * B + b] = fin[r];
    const long long plane = (long long)k * B * steps;
    long long* tk = taken + ((long long)r * B + b) * steps;
    int t = Tb, u = Ub, kind = fin_kind[r], rank = fin_rank[r];
    for (int s = 0; ; s++) {
        const int* e = table + 6 * kind;
        t -= e[2]; u -= e[1];
        tk[s] = t; tk[plane + s] = u; tk[2 * plane + s] = kind;
        if (t == 0 && u == 0) break;
        const long long n = node_index(b, t, u, T, U1) * k + rank;
        kind = kinds[n]; rank = ranks[n];
    }
}
