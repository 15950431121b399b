// The graph lattice on a GPU (written by nbs/12b_graph_cuda.ipynb): log Z of each sequence's graph through its frames
// and, for the backward, its posteriors, in log space in FLOAT, in the semiring of the macros (Log: SUM is logsumexp;
// Max: SUM is max, and the posteriors are the best path's arcs). The graphs come packed as `pack_graphs` lays them out:
// states and arcs numbered one graph after another (src, dst, lab per arc; in_ptr/in_arcs the emitting arcs by
// destination, out_ptr/out_arcs by source, eps_ptr/eps_arcs the epsilon arcs in a topological order of their sources),
// and `bylab_ptr`/`bylab` each graph's emitting arcs by the label they read (glab: the labels a graph reads). The
// epsilon arcs by levels (`_epsilon_levels`): graph g's levels lvl_off[g] <= k < lvl_off[g + 1]; forward, level k the
// states fw_state[fw_lvl[k] .. fw_lvl[k + 1]] of one depth (the longest chain of epsilon arcs into them), shallowest
// first, state i's arcs in fw_arcs[fw_ptr[i] .. fw_ptr[i + 1]]; backward, the sources of one depth, deepest first
// (bw_lvl, bw_state, bw_ptr, bw_arcs), a source's arcs in reverse order.
#include "semiring.cuh"

typedef long long i64;

// A score at or below this is no path: -inf (the accumulators start at ZERO, -1e38, so that no sum sees -inf - -inf).
#define NO_PATH ((FLOAT)-1e30)

// Where alpha[t] (a sequence's S_max forward scores after t frames) is kept. For the backward, every K-th frame's in
// the checkpoints ck (T / K + 1 rows; K = 1: every frame), the frames between two checkpoints in the scratch seg (K - 1
// rows), which the backward pass refills a segment at a time, latest first. The last frame, where it is no checkpoint,
// stays in seg until the backward has read it: its segment, the first refilled, ends before it. Without the backward,
// two rows in turn.
__device__ __forceinline__ FLOAT* alpha_row(FLOAT* ck, FLOAT* seg, int t, int K, int S_max, int for_backward) {
    if (!for_backward) return ck + (i64)(t & 1) * S_max;
    if (t % K == 0) return ck + (i64)(t / K) * S_max;
    return seg + (i64)(t % K - 1) * S_max;
}

// alpha[dst] (+)= alpha[src] (x) w along a graph's epsilon arcs, a level at a time (their sources, shallower, are final):
// a thread a state of the level, summing the arcs into it in the order of eps_arcs; a barrier after each level.
__device__ void epsilon_forward(FLOAT* a, i64 l0, i64 l1, const i64* __restrict__ fw_lvl, const i64* __restrict__ fw_state,
                                const i64* __restrict__ fw_ptr, const i64* __restrict__ fw_arcs, const i64* __restrict__ src,
                                const FLOAT* __restrict__ w, i64 s0) {
    for (i64 k = l0; k < l1; k++) {
        for (i64 i = fw_lvl[k] + threadIdx.x; i < fw_lvl[k + 1]; i += blockDim.x) {
            const i64 v = fw_state[i] - s0;
            FLOAT acc = a[v];
            for (i64 j = fw_ptr[i]; j < fw_ptr[i + 1]; j++) acc = SUM(acc, MUL(a[src[fw_arcs[j]] - s0], w[fw_arcs[j]]));
            a[v] = acc;
        }
        __syncthreads();
    }
#undef ROW
#undef FORWARD_FRAME
#undef RECOMPUTE
#undef SEGMENT_ENDS_AT
}

// cur = alpha[t + 1] from prev = alpha[t] and the frame's emissions Lt: the emitting arcs into each state (a thread a
// state, the arcs in in_arcs' order), a barrier, then the epsilon arcs by levels. The forward pass and the backward's
// recomputed segments both take this, so a recomputed row has the bits of the forward's.
__device__ void forward_frame(const FLOAT* prev, FLOAT* cur, const FLOAT* __restrict__ Lt, int S, i64 s0,
                              const i64* __restrict__ in_ptr, const i64* __restrict__ in_arcs, const i64* __restrict__ src,
                              const i64* __restrict__ lab, const FLOAT* __restrict__ w, i64 l0, i64 l1,
                              const i64* __restrict__ fw_lvl, const i64* __restrict__ fw_state, const i64* __restrict__ fw_ptr,
                              const i64* __restrict__ fw_arcs) {
    for (int v = threadIdx.x; v < S; v += blockDim.x) {
        FLOAT acc = ZERO;
        for (i64 j = in_ptr[s0 + v]; j < in_ptr[s0 + v + 1]; j++) {
            const i64 e = in_arcs[j];
            acc = SUM(acc, MUL(MUL(prev[src[e] - s0], w[e]), Lt[lab[e]]));
        }
        cur[v] = acc;
    }
    __syncthreads();
    epsilon_forward(cur, l0, l1, fw_lvl, fw_state, fw_ptr, fw_arcs, src, w, s0);
}

// A sampling walk's step at frame t from state v (the CPU's `_graph_sample_cpu`): its candidates' log weights, in double.
// kind 0: the final states (alpha_T (x) fin); 1: what the frame read (`pre`, index 0) or an epsilon arc of the graph
// into v (index 1 + k: eps_arcs[e0 + k]; none unless into v); 2: the emitting arcs into v (in_arcs[j0 + i]) from the
// frame before. A score at or below NO_PATH is none (-inf).
struct WalkStep { const FLOAT* at; const FLOAT* before; const FLOAT* Lt; i64 v, s0, e0, j0; double pre; };

__device__ double walk_weight(const WalkStep& c, int kind, i64 i, const FLOAT* __restrict__ fin, const i64* __restrict__ src,
                              const i64* __restrict__ dst, const i64* __restrict__ lab, const FLOAT* __restrict__ w,
                              const i64* __restrict__ eps_arcs, const i64* __restrict__ in_arcs) {
    FLOAT x;
    if (kind == 0) x = MUL(c.at[i], fin[c.s0 + i]);
    else if (kind == 1) {
        if (i == 0) return c.pre;
        const i64 e = eps_arcs[c.e0 + i - 1];
        if (dst[e] - c.s0 != c.v) return -INFINITY;
        x = MUL(c.at[src[e] - c.s0], w[e]);
    } else {
        const i64 e = in_arcs[c.j0 + i];
        x = MUL(MUL(c.before[src[e] - c.s0], w[e]), c.Lt[lab[e]]);
    }
    return x > NO_PATH ? (double)x : -INFINITY;
}

// A walk's m arcs, written last first from the end of its row of P, moved to the row's front (first arc first), -1 after.
__device__ void path_to_front(long long* path, i64 m, int P) {
    for (i64 i = 0; i < m; i++) path[i] = path[P - m + i];
    for (i64 i = m; i < P; i++) path[i] = -1;
}

// The candidate (of n) whose cumulative weight first exceeds u times the total, as `choose_index` and the CPU's `_draw`
// choose (the last that counts, if rounding leaves u times the total out of reach): three passes over the weights.
__device__ i64 walk_draw(const WalkStep& c, int kind, i64 n, double u, const FLOAT* __restrict__ fin, const i64* __restrict__ src,
                         const i64* __restrict__ dst, const i64* __restrict__ lab, const FLOAT* __restrict__ w,
                         const i64* __restrict__ eps_arcs, const i64* __restrict__ in_arcs) {
#define WEIGHT(i) walk_weight(c, kind, (i), fin, src, dst, lab, w, eps_arcs, in_arcs)
    double m = -INFINITY, tot = 0.0, acc = 0.0;
    for (i64 i = 0; i < n; i++) m = max2(m, WEIGHT(i));
    for (i64 i = 0; i < n; i++) { const double x = WEIGHT(i); if (x > -INFINITY) tot += exp(x - m); }
    i64 last = 0;
    for (i64 i = 0; i < n; i++) {
        const double x = WEIGHT(i);
        if (x > -INFINITY) { acc += exp(x - m); last = i; if (acc > u * tot) return i; }
    }
    return last;
#undef WEIGHT
}

// One block per sequence n, threads over the states of its graph (strided when there are more states than threads).
// 1. forward: alpha[t] (its graph's S_g scores after t frames and their epsilon arcs) for t = 0 .. T_n, kept as
//    `alpha_row` says in alpha (N, T / K + 1, S_max) and seg (N, K - 1, S_max) (without the backward:
//    alpha (N, 2, S_max)), log Z into logz[n] (-inf where no path fits).
// 2. with for_backward, latest frame first, a segment of K frames at a time (K > 1: its rows recomputed into seg
//    from its first checkpoint by the whole block, then walked back). Log: beta a level at a time (two rows of beta_buf
//    (N, 2, S_max)) and the posteriors exp(alpha[t - 1][src a] + w_a + lp[t - 1, n, lab a] + beta[t][dst a] - log Z):
//    each emitting arc's added by the thread of its source state into post_arcs (N, E_max), each label's summed over
//    the arcs that read it (bylab, in a fixed order: no atomics) into post_lp (T, N, C), the epsilon arcs' by the thread
//    of their source (a level at a time), the final states' into post_finals (N, S_max). Max: one thread walks the best
//    path back (the first epsilon arc, else the first emitting arc, whose score makes the state's: the same sums in the
//    same order as the forward's, so the comparison is exact) and adds 1 on each of its arcs, labels and its final state;
//    with P > 0 it also writes the path, its arcs (numbered within the graph) first to last, into paths[n] (N, P), -1
//    after them (a row the caller filled with -1 stays so where no path fits). Log with SAMPLES and draws > 0: no posteriors, but
//    `draws` samples of the paths instead (forward filtering, backward sampling, the CPU's `_graph_sample_cpu`): thread
//    d's draws d, d + blockDim.x, ... walk back together a frame at a time (their state in walk (N, draws, 3)), each
//    step drawn by the next of its uniforms (draws, N, n_uniforms), the paths written as Max's into (draws, N, P).
// The epsilon arcs into a state are summed in eps_arcs' order, and those out of it in the reverse, whatever the levels:
// the CPU kernel's order, so the result does not depend on the block's size (nor on K: a row is the same sums).
extern "C" __global__ void __launch_bounds__(256, 2) graph_logz(
    const FLOAT* __restrict__ lp, const long long* __restrict__ lengths, const long long* __restrict__ seq_graph,
    const FLOAT* __restrict__ w, const FLOAT* __restrict__ fin, const long long* __restrict__ src,
    const long long* __restrict__ dst, const long long* __restrict__ lab, const long long* __restrict__ in_ptr,
    const long long* __restrict__ in_arcs, const long long* __restrict__ out_ptr, const long long* __restrict__ out_arcs,
    const long long* __restrict__ eps_ptr, const long long* __restrict__ eps_arcs, const long long* __restrict__ g_state,
    const long long* __restrict__ g_start, const long long* __restrict__ g_arc, const long long* __restrict__ glab_ptr,
    const long long* __restrict__ glab, const long long* __restrict__ bylab_ptr, const long long* __restrict__ bylab,
    const long long* __restrict__ lvl_off, const long long* __restrict__ fw_lvl, const long long* __restrict__ fw_state,
    const long long* __restrict__ fw_ptr, const long long* __restrict__ fw_arcs, const long long* __restrict__ bw_lvl,
    const long long* __restrict__ bw_state, const long long* __restrict__ bw_ptr, const long long* __restrict__ bw_arcs,
    FLOAT* __restrict__ alpha, FLOAT* __restrict__ seg, FLOAT* __restrict__ beta_buf, FLOAT* __restrict__ logz,
    FLOAT* __restrict__ post_lp, double* __restrict__ post_arcs, double* __restrict__ post_finals, long long* __restrict__ paths,
    const double* __restrict__ uniforms, long long* __restrict__ walk, int T, int N, int C, int S_max, int E_max, int K, int P,
    int draws, int n_uniforms, int for_backward, int use_max)
{
    const int n = blockIdx.x;
    const i64 g = seq_graph[n], s0 = g_state[g], e0 = eps_ptr[g], e1 = eps_ptr[g + 1];
    const int S = (int)(g_state[g + 1] - s0);                    // the graph's states (local numbers 0 .. S - 1)
    const i64 a0 = g_arc[g], l0 = lvl_off[g], l1 = lvl_off[g + 1];
    const int Tn = (int)lengths[n];
    const int R = for_backward ? T / K + 1 : 2;                  // kept rows a sequence
    FLOAT* ck = alpha + (i64)n * R * S_max;
    FLOAT* sg = seg + (i64)n * (K - 1) * S_max;
    const FLOAT* L = lp + (i64)n * C;                             // L + t * N * C: frame t's emissions
    const i64 frame = (i64)N * C;
#define ROW(t) alpha_row(ck, sg, (t), K, S_max, for_backward)
#define FORWARD_FRAME(t) forward_frame(ROW(t), ROW((t) + 1), L + (i64)(t) * frame, S, s0, in_ptr, in_arcs, src, lab, w, \
                                       l0, l1, fw_lvl, fw_state, fw_ptr, fw_arcs)
// segment k's rows between its checkpoints (frames kK + 1 .. min(kK + K, T_n) - 1) into seg, from checkpoint k
#define RECOMPUTE(k) for (int s = (k) * K; s < min((k) * K + K, Tn) - 1; s++) FORWARD_FRAME(s)
// the first frame of a segment walked back (the whole block alike): its rows are refilled before the frame's step
#define SEGMENT_ENDS_AT(t) ((t) > 0 && K > 1 && ((t) == Tn || (t) % K == 0))

    // 1. the forward pass
    FLOAT* A0 = ROW(0);
    for (int v = threadIdx.x; v < S; v += blockDim.x) A0[v] = s0 + v == g_start[g] ? (FLOAT)ONE : (FLOAT)ZERO;
    __syncthreads();
    epsilon_forward(A0, l0, l1, fw_lvl, fw_state, fw_ptr, fw_arcs, src, w, s0);
    for (int t = 0; t < Tn; t++) FORWARD_FRAME(t);
    const FLOAT* AT = ROW(Tn);
    __shared__ FLOAT Z;                                           // log Z, as every thread reads it
    if (threadIdx.x == 0) {
        FLOAT z = ZERO;
        for (int v = 0; v < S; v++) z = SUM(z, MUL(AT[v], fin[s0 + v]));
        Z = z;
        logz[n] = z <= NO_PATH ? (FLOAT)-INFINITY : z;
    }
    __syncthreads();
    if (!for_backward || Z <= NO_PATH) return;                    // (the whole block alike: no barrier is left behind)

    // 2. the posteriors: Max, the best path (thread 0 walks; the others stay only to recompute segments)
    if (use_max) {
        const bool walker = threadIdx.x == 0;
        if (K == 1 && !walker) return;                            // (every frame kept: K == 1 for the whole block)
        long long* path = paths + (i64)n * P;                     // the arcs found, last first, from the row's end
        i64 v = 0, m = 0;
        if (walker) {
            for (int u = 1; u < S; u++) if (MUL(AT[u], fin[s0 + u]) > MUL(AT[v], fin[s0 + v])) v = u;
            post_finals[(i64)n * S_max + v] = 1.0;
        }
        for (int t = Tn; t >= 0; t--) {
            if (SEGMENT_ENDS_AT(t)) {
                __syncthreads();                                  // (the walk has left the segment after this one)
                RECOMPUTE((t - 1) / K);
            }
            if (!walker) continue;
            const FLOAT* at = ROW(t);
            for (bool moved = true; moved;) {                        // epsilon arcs into v at this frame
                moved = false;
                for (i64 k = e0; k < e1; k++) {
                    const i64 e = eps_arcs[k];
                    if (dst[e] - s0 == v && MUL(at[src[e] - s0], w[e]) == at[v]) {
                        post_arcs[(i64)n * E_max + e - a0] += 1.0; v = src[e] - s0; moved = true;
                        if (m < P) path[P - 1 - m++] = e - a0;
                        break;
                    }
                }
            }
            if (t == 0) break;
            const FLOAT* before = ROW(t - 1);
            for (i64 j = in_ptr[s0 + v]; j < in_ptr[s0 + v + 1]; j++) {
                const i64 e = in_arcs[j];
                if (MUL(MUL(before[src[e] - s0], w[e]), L[(t - 1) * frame + lab[e]]) == at[v]) {
                    post_arcs[(i64)n * E_max + e - a0] += 1.0;
                    post_lp[(t - 1) * frame + n * C + lab[e]] += (FLOAT)1;
                    v = src[e] - s0;
                    if (m < P) path[P - 1 - m++] = e - a0;
                    break;
                }
            }
        }
        if (walker) path_to_front(path, m, P);
        return;
    }

    // 2. samples (Log, draws > 0; the instantiation with SAMPLES 1 alone, so that the loss's carries no walk's registers):
    // each thread's draws walk back, the whole block refilling the segments
    if (SAMPLES && draws > 0) {
#define DRAW(c, kind, n, u) walk_draw((c), (kind), (n), (u), fin, src, dst, lab, w, eps_arcs, in_arcs)
        for (int d = threadIdx.x; d < draws; d += blockDim.x) {      // the final state: the first uniform
            const WalkStep c = {AT, AT, L, 0, s0, e0, 0, 0.0};
            i64* wk = walk + ((i64)n * draws + d) * 3;               // the draw's state, uniforms used, arcs found
            wk[0] = DRAW(c, 0, S, uniforms[((i64)d * N + n) * n_uniforms]); wk[1] = 1; wk[2] = 0;
        }
        for (int t = Tn; t >= 0; t--) {
            if (SEGMENT_ENDS_AT(t)) {
                __syncthreads();                                  // (every draw has left the segment after this one)
                RECOMPUTE((t - 1) / K);
            }
            const FLOAT* at = ROW(t);
            const FLOAT* before = t > 0 ? ROW(t - 1) : at;
            const FLOAT* Lt = L + (i64)max(t - 1, 0) * frame;
            for (int d = threadIdx.x; d < draws; d += blockDim.x) {
                i64* wk = walk + ((i64)n * draws + d) * 3;
                const double* ud = uniforms + ((i64)d * N + n) * n_uniforms;
                long long* path = paths + ((i64)d * N + n) * P;
                i64 v = wk[0], used = wk[1], m = wk[2];
                for (;;) {                                            // epsilon arcs into v, or what the frame read
                    double pre = s0 + v == g_start[g] ? 0.0 : -INFINITY;
                    if (t > 0) {
                        FLOAT acc = ZERO;
                        for (i64 j = in_ptr[s0 + v]; j < in_ptr[s0 + v + 1]; j++) {
                            const i64 e = in_arcs[j];
                            acc = SUM(acc, MUL(MUL(before[src[e] - s0], w[e]), Lt[lab[e]]));
                        }
                        pre = acc > NO_PATH ? (double)acc : -INFINITY;
                    }
                    const WalkStep c = {at, before, Lt, v, s0, e0, 0, pre};
                    const i64 pick = DRAW(c, 1, e1 - e0 + 1, ud[used < n_uniforms ? used : n_uniforms - 1]);
                    used++;
                    if (pick == 0) break;
                    const i64 e = eps_arcs[e0 + pick - 1];
                    if (m < P) path[P - 1 - m++] = e - a0;
                    v = src[e] - s0;
                }
                if (t > 0) {                                          // then the emitting arc into v
                    const WalkStep c = {at, before, Lt, v, s0, e0, in_ptr[s0 + v], 0.0};
                    const i64 e = in_arcs[in_ptr[s0 + v] + DRAW(c, 2, in_ptr[s0 + v + 1] - in_ptr[s0 + v],
                                                                 ud[used < n_uniforms ? used : n_uniforms - 1])];
                    used++;
                    if (m < P) path[P - 1 - m++] = e - a0;
                    v = src[e] - s0;
                }
                wk[0] = v; wk[1] = used; wk[2] = m;
            }
        }
        for (int d = threadIdx.x; d < draws; d += blockDim.x)
            path_to_front(paths + ((i64)d * N + n) * P, walk[((i64)n * draws + d) * 3 + 2], P);
        return;
#undef DRAW
    }

    // 2. the posteriors: Log, the backward pass
    FLOAT* beta = beta_buf + (i64)n * 2 * S_max;                  // the level's beta; the next one's at beta + S_max
    const i64 u0 = glab_ptr[g];
    const int U = (int)(glab_ptr[g + 1] - u0);
    for (int v = threadIdx.x; v < S; v += blockDim.x) {
        const FLOAT f = fin[s0 + v] > (FLOAT)ZERO ? fin[s0 + v] : (FLOAT)ZERO;
        beta[v] = f;
        post_finals[(i64)n * S_max + v] = (double)exp(MUL(AT[v], fin[s0 + v]) - Z);
    }
    __syncthreads();
    for (int t = Tn; t >= 0; t--) {
        if (SEGMENT_ENDS_AT(t)) RECOMPUTE((t - 1) / K);              // (the frame before ended on a barrier)
        const FLOAT* at = ROW(t);
        for (i64 k = l0; k < l1; k++) {                              // the epsilon arcs of level t, by their sources'
            for (i64 i = bw_lvl[k] + threadIdx.x; i < bw_lvl[k + 1]; i += blockDim.x) {     // depth, deepest first
                const i64 u = bw_state[i] - s0;
                FLOAT acc = beta[u];
                for (i64 j = bw_ptr[i]; j < bw_ptr[i + 1]; j++) {
                    const i64 e = bw_arcs[j];
                    const FLOAT x = MUL(w[e], beta[dst[e] - s0]);
                    post_arcs[(i64)n * E_max + e - a0] += (double)exp(at[u] + x - Z);
                    acc = SUM(acc, x);
                }
                beta[u] = acc;
            }
            __syncthreads();
        }
        if (t == 0) break;
        const FLOAT* before = ROW(t - 1);
        const FLOAT* Lt = L + (i64)(t - 1) * frame;
        FLOAT* nb = beta + S_max;
        for (int u = threadIdx.x; u < S; u += blockDim.x) {          // the arcs leaving level t - 1, by source
            FLOAT acc = ZERO;
            for (i64 j = out_ptr[s0 + u]; j < out_ptr[s0 + u + 1]; j++) {
                const i64 e = out_arcs[j];
                const FLOAT x = MUL(MUL(w[e], Lt[lab[e]]), beta[dst[e] - s0]);
                acc = SUM(acc, x);
                post_arcs[(i64)n * E_max + e - a0] += (double)exp(before[u] + x - Z);
            }
            nb[u] = acc;
        }
        for (int k = threadIdx.x; k < U; k += blockDim.x) {          // the same posteriors, summed per label
            FLOAT p = 0;
            for (i64 j = bylab_ptr[u0 + k]; j < bylab_ptr[u0 + k + 1]; j++) {
                const i64 e = bylab[j];
                const FLOAT x = MUL(MUL(w[e], Lt[lab[e]]), beta[dst[e] - s0]);
                p += exp(before[src[e] - s0] + x - Z);
            }
            post_lp[(t - 1) * frame + n * C + glab[u0 + k]] = p;
        }
        __syncthreads();
        for (int v = threadIdx.x; v < S; v += blockDim.x) beta[v] = nb[v];
        __syncthreads();
    }
#undef ROW
#undef FORWARD_FRAME
#undef RECOMPUTE
#undef SEGMENT_ENDS_AT
}
