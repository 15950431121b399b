// The lattice questions over the CTC-CRF's lattices (written by nbs/05a_crf_questions.ipynb).
#include "semiring.cuh"


// ---- the lattice questions (entropy, KL) on a sparse lattice: the CRF's paths, or a read's alignments ----
// Block (n, 0) of sequence n, its threads striding over the C states: the forward recursion of the algebra ALG into
// `fwd` (3, N, T+1, C): state c at frame t + 1 sums its NZ in-edges, each its source's state at frame t times the
// edge's scores Ms[t, n, c, j] (p's, and q's for KL), folded three, then two more, at a time as `_sparse_alpha_row`
// folds them; out[n] = (log Z_p, log Z_q, accumulator) over the final states times vT. With `with_grad` the backward
// recursion runs over each state's out-edges (`rev`, (C, D) flat edge indices c * NZ + j, -1 past the last). `split`:
// in block (n, 1), at the same time as the forward, into every frame of `bwd` (3, N, T+1, C), and `crf_divergence_grad`
// takes the edges' gradients after; else (fused: a block a sequence, less memory) after the forward in the same block,
// in two frames of `bwd` (3, N, 2, C), each frame's edges' closed-form gradients (`alg_edge_grad`) going into grad_p
// (and grad_q), (T, N, C, NZ), as it goes. They are left as they are (zero) for a sequence with no path. Scores of
// -inf are no edge.
#include "semiring.cuh"
#ifndef ALG
#define ALG 1
#endif

// The state of a lattice edge: a state s's (p, q, c) times the edge's scores (q: -inf for Entropy).
__device__ __forceinline__ AlgState crf_edge(const double* S, long long stride, long long at, const FLOAT* Mp,
                                             const FLOAT* Mq, long long e) {
    const AlgState x = alg_load(S, stride, at);
    return alg_state(x.p + (double)Mp[e], ALG == ALG_KL ? x.q + (double)Mq[e] : -INFINITY, x.c);
}

extern "C" __global__ void crf_divergence(
    const FLOAT* __restrict__ Mp, const FLOAT* __restrict__ Mq, const long long* __restrict__ idx,
    const long long* __restrict__ rev, int D, const double* __restrict__ v0, const double* __restrict__ vT,
    double* __restrict__ fwd, double* __restrict__ bwd, FLOAT* __restrict__ grad_p, FLOAT* __restrict__ grad_q,
    double* __restrict__ out, int T, int N, int C, int NZ, int with_grad, int split)
{
    const int n = blockIdx.x, kept = split ? T + 1 : 2;     // the backward frames kept
    const bool kl = ALG == ALG_KL;
    const AlgState zero = alg_state(-INFINITY, -INFINITY, 0.0);
    const long long fs = (long long)N * (T + 1) * C, bs = (long long)N * kept * C;  // a component's stride
    double* F = fwd + (long long)n * (T + 1) * C;                                   // F[t * C + c]
    double* Bk = bwd + (long long)n * kept * C;                                     // Bk[(t % kept) * C + c]
    double zp = 0.0, zq = 0.0, total = 0.0;
    if (blockIdx.y == 0) {                                  // the forward recursion
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const double v = v0[(long long)n * C + c];
            alg_store(F, fs, c, alg_state(v, kl ? v : -INFINITY, 0.0));
        }
        __syncthreads();
        // in-edge j of state c at frame t (zero past NZ)
        #define IN_EDGE(t, c, j) ((j) < NZ ? crf_edge(F, fs, (long long)(t) * C + idx[(long long)(c) * NZ + (j)], \
                                                      Mp, Mq, row + (long long)(c) * NZ + (j)) : zero)
        for (int t = 0; t < T; t++) {
            const long long row = ((long long)t * N + n) * C * NZ;                  // Ms[t, n]
            for (int c = threadIdx.x; c < C; c += blockDim.x) {
                AlgState a = alg_plus3<ALG>(IN_EDGE(t, c, 0), IN_EDGE(t, c, 1), IN_EDGE(t, c, 2));
                for (int j = 3; j < NZ; j += 2) a = alg_plus3<ALG>(a, IN_EDGE(t, c, j), IN_EDGE(t, c, j + 1));
                alg_store(F, fs, (long long)(t + 1) * C + c, a);
            }
            __syncthreads();                                // frame t + 1 is written before it is read
        }
        #undef IN_EDGE
        AlgState fin = zero;                                // every thread folds the final states alike, two at a time
        for (int c = 0; c < C; c += 2) {
            const double e0 = vT[(long long)n * C + c], e1 = c + 1 < C ? vT[(long long)n * C + c + 1] : -INFINITY;
            const AlgState x = alg_load(F, fs, (long long)T * C + c),
                           y = alg_load(F, fs, (long long)T * C + (c + 1 < C ? c + 1 : c));
            fin = alg_plus3<ALG>(fin, alg_times(x, e0, e0), alg_times(y, e1, e1));
        }
        zp = fin.p; zq = kl ? fin.q : zp; total = fin.c;
        if (threadIdx.x == 0) { out[3 * n] = zp; out[3 * n + 1] = zq; out[3 * n + 2] = total; }
        if (!with_grad || split || zp == -INFINITY || zq == -INFINITY) return;   // (the whole block: no barrier skipped)
    }
    for (int c = threadIdx.x; c < C; c += blockDim.x) {     // the backward recursion
        const double v = vT[(long long)n * C + c];
        alg_store(Bk, bs, (long long)(T % kept) * C + c, alg_state(v, v, 0.0));
    }
    __syncthreads();
    // out-edge i of state s at frame t: its end's backward state at frame t + 1 times the edge's scores (zero past D)
    #define OUT_EDGE(s, i) ((i) < D && rev[(long long)(s) * D + (i)] >= 0 \
        ? crf_edge(Bk, bs, (long long)cur * C + rev[(long long)(s) * D + (i)] / NZ, Mp, Mq, row + rev[(long long)(s) * D + (i)]) : zero)
    for (int t = T - 1; t >= 0; t--) {
        const long long row = ((long long)t * N + n) * C * NZ;
        const int cur = (t + 1) % kept;
        for (int c = threadIdx.x; c < C && !split; c += blockDim.x) {   // frame t's edges into c: their gradients
            const AlgState w = alg_load(Bk, bs, (long long)cur * C + c);
            for (int j = 0; j < NZ; j++) {
                const long long e = row + (long long)c * NZ + j;
                const AlgState f = alg_load(F, fs, (long long)t * C + idx[(long long)c * NZ + j]);
                double gp, gq;
                alg_edge_grad<ALG>(f, (double)Mp[e], kl ? (double)Mq[e] : 0.0, w, zp, zq, total, &gp, &gq);
                grad_p[e] = (FLOAT)gp;
                if (kl) grad_q[e] = (FLOAT)gq;
            }
        }
        if (t == 0) break;                                  // (the same t for every thread)
        for (int s = threadIdx.x; s < C; s += blockDim.x) {       // frame t's backward states: the out-edges, folded
            AlgState a = alg_plus3<ALG>(OUT_EDGE(s, 0), OUT_EDGE(s, 1), OUT_EDGE(s, 2));
            for (int i = 3; i < D; i += 2) a = alg_plus3<ALG>(a, OUT_EDGE(s, i), OUT_EDGE(s, i + 1));
            alg_store(Bk, bs, (long long)(t % kept) * C + s, a);
        }
        __syncthreads();                                    // frame t is written before the next step reads it
    }
    #undef OUT_EDGE
}

// `split`'s edge gradients: thread e of the (T, N, C, NZ) edges, from its source's forward state at frame t and its
// end's backward state at frame t + 1 (`crf_divergence`'s tables, every frame), as the fused kernel takes them; left
// as they are (zero) for a sequence with no path.
extern "C" __global__ void crf_divergence_grad(
    const FLOAT* __restrict__ Mp, const FLOAT* __restrict__ Mq, const long long* __restrict__ idx,
    const double* __restrict__ fwd, const double* __restrict__ bwd, const double* __restrict__ out,
    FLOAT* __restrict__ grad_p, FLOAT* __restrict__ grad_q, int T, int N, int C, int NZ)
{
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long long)T * N * C * NZ) return;
    const int j = (int)(e % NZ), c = (int)(e / NZ % C), n = (int)(e / NZ / C % N), t = (int)(e / NZ / C / N);
    const double zp = out[3 * n], zq = out[3 * n + 1], total = out[3 * n + 2];
    if (zp == -INFINITY || zq == -INFINITY) return;
    const long long fs = (long long)N * (T + 1) * C, at = (long long)n * (T + 1) * C;   // both tables' layout
    const AlgState f = alg_load(fwd + at, fs, (long long)t * C + idx[(long long)c * NZ + j]);
    const AlgState w = alg_load(bwd + at, fs, (long long)(t + 1) * C + c);
    double gp, gq;
    alg_edge_grad<ALG>(f, (double)Mp[e], ALG == ALG_KL ? (double)Mq[e] : 0.0, w, zp, zq, total, &gp, &gq);
    grad_p[e] = (FLOAT)gp;
    if (ALG == ALG_KL) grad_q[e] = (FLOAT)gq;
}

// Backward sampling over the forward scores `alpha` (T+1, N, C) in log space (the loss's, `sparse_fwd`): thread
// n * n_samples + i walks sample i of sequence n back, frame T - 1 taking an edge e = c * NZ + j among all in proportion to
// exp(alpha[T-1, idx[e]] + Ms[T-1, n, e] + vT[n, c]), each earlier frame t one of the edges into the state that frame
// t + 1's edge leaves, by the uniform u[i, t, n]: `choose_index`'s rule (weights relative to their largest, the first
// whose running sum exceeds u times the total, never one of weight 0), in three passes over the candidates (no
// per-thread arrays: semiring.cuh's `choose_log`, its loads unrolled), so the same uniforms give the reference's samples.
// edges[i, t, n] = e; nothing is written for a sequence with no path (log Z at the semiring's zero).
struct CrfEdgeWeights {   // the log-weight of candidate edge first + k: its source's alpha, its score, (last frame) its end's vT
    const FLOAT* alpha_t; const FLOAT* ms_t; const long long* idx; const double* vT; int first, NZ;
    __device__ double operator()(int k) const {
        const int e = first + k;
        return (double)alpha_t[idx[e]] + (double)ms_t[e] + (vT ? vT[e / NZ] : 0.0);
    }
};
__device__ __forceinline__ int crf_pick(const FLOAT* alpha_t, const FLOAT* ms_t, const long long* idx, const double* vT,
                                        int first, int count, int NZ, double u) {
    const CrfEdgeWeights w = {alpha_t, ms_t, idx, vT, first, NZ};
    return first + choose_log(w, count, u);
}

extern "C" __global__ void crf_sample(
    const FLOAT* __restrict__ Ms, const long long* __restrict__ idx, const FLOAT* __restrict__ alpha,
    const double* __restrict__ vT, const double* __restrict__ logz, const double* __restrict__ u,
    long long* __restrict__ edges, int n_samples, int T, int N, int C, int NZ)
{
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)n_samples * N) return;
    const int n = (int)(id / n_samples);                    // a sequence's samples side by side: at the last frame they
    const long long i = id % n_samples;                     // read the same candidates at once (one load serves them)
    if (logz[n] <= -1e30) return;
    const long long E = (long long)C * NZ;
    #define AT(t) ((long long)(i * T + (t)) * N + n)                   // [i, t, n] of u and edges
    int e = crf_pick(alpha + ((long long)(T - 1) * N + n) * C, Ms + ((long long)(T - 1) * N + n) * E, idx,
                     vT + (long long)n * C, 0, (int)E, NZ, u[AT(T - 1)]);
    edges[AT(T - 1)] = e;
    for (int t = T - 2; t >= 0; t--) {
        const int s = (int)idx[e];                          // the state frame t + 1's edge leaves: frame t enters it
        e = crf_pick(alpha + ((long long)t * N + n) * C, Ms + ((long long)t * N + n) * E, idx, nullptr, s * NZ, NZ, NZ,
                     u[AT(t)]);
        edges[AT(t)] = e;
    }
    #undef AT
}

// The k best paths (KMax(k), k <= 16) of a sparse lattice, one block per sequence, as the CPU kernel
// `_sparse_kbest_cpu`: each state's k best scores into it, sorted, by merging its NZ in-edges' lists rank by rank (a
// head per edge: its score plus its source's next best; the largest wins, ties to the lower edge), two frames of them
// in `vals` (N x 2 x C x k), and for each (frame, state, rank) where it came from, 16 * j + the source's rank (`back`,
// int16, T x N x C x k). A thread's heads (value and rank, NZ of each) live in dynamic shared memory, made once a state:
// a rank then costs one load (the winner's next), where reading every head from global memory cost NZ. Then thread 0 takes the k best ends (state, rank) with vT, in the states' order (an insertion into the sorted top k,
// as the CPU kernel does), and thread q < k walks the q-th back: edges[q, t, n] = c * NZ + j (left as they are where
// there are fewer than k paths). Scores at or below -1e30 (the semiring's finite zero, or sums of it) are no edge.
extern "C" __global__ void crf_kbest(
    const FLOAT* __restrict__ Ms, const long long* __restrict__ idx, const double* __restrict__ v0,
    const double* __restrict__ vT, double* __restrict__ vals, short* __restrict__ back, long long* __restrict__ edges,
    int T, int N, int C, int NZ, int k)
{
    extern __shared__ double smem_heads[];                  // head j of this thread at head[j * B], its rank at at[j * B]
    const int n = blockIdx.x, B = blockDim.x;
    const double none_below = -1e30;                        // ZERO_BELOW
    double* head = smem_heads + threadIdx.x;
    unsigned char* at = (unsigned char*)(smem_heads + (long long)NZ * B) + threadIdx.x;
    double* V = vals + (long long)n * 2 * C * k;            // frame t's lists (before its edges: v0) at V + (t % 2) * C * k
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const double v = v0[(long long)n * C + c];
        for (int r = 0; r < k; r++) V[c * k + r] = r == 0 && v > none_below ? v : -INFINITY;
    }
    for (int t = 0; t < T; t++) {
        __syncthreads();                                    // the frame before is written
        const double* prev = V + (t % 2) * C * k;
        double* cur = V + ((t + 1) % 2) * C * k;
        const FLOAT* m = Ms + ((long long)t * N + n) * C * NZ;
        for (int c = threadIdx.x; c < C; c += B) {
            const FLOAT* mc = m + (long long)c * NZ;
            const long long* src = idx + (long long)c * NZ;
            for (int j = 0; j < NZ; j++) {                  // each edge's head: its score plus its source's best
                const double x = (double)mc[j];
                at[j * B] = 0;
                head[j * B] = x > none_below ? x + prev[src[j] * k] : -INFINITY;
            }
            int r = 0;
            for (; r < k; r++) {
                double best = -INFINITY;
                int bj = -1;
                for (int j = 0; j < NZ; j++) if (head[j * B] > best) { best = head[j * B]; bj = j; }
                if (bj < 0) break;
                cur[c * k + r] = best;
                const int a = at[bj * B];
                back[(((long long)t * N + n) * C + c) * k + r] = (short)(16 * bj + a);
                at[bj * B] = (unsigned char)(a + 1);        // the winner's next head (none past its k)
                head[bj * B] = a + 1 < k ? (double)mc[bj] + prev[src[bj] * k + a + 1] : -INFINITY;
            }
            for (; r < k; r++) cur[c * k + r] = -INFINITY;
        }
    }
    __syncthreads();
    const double* last = V + (T % 2) * C * k;
    __shared__ double top[16];
    __shared__ int top_c[16], top_r[16];
    if (threadIdx.x == 0) {                                 // the k best ends
        for (int r = 0; r < k; r++) top[r] = -INFINITY;
        for (int c = 0; c < C; c++) {
            const double end = vT[(long long)n * C + c];
            if (!(end > none_below)) continue;
            for (int r = 0; r < k; r++) {
                const double x = last[c * k + r] + end;
                if (!(x > top[k - 1])) break;               // (a state's list is sorted: the rest are no better)
                int q = k - 1;
                for (; q > 0 && top[q - 1] < x; q--) { top[q] = top[q - 1]; top_c[q] = top_c[q - 1]; top_r[q] = top_r[q - 1]; }
                top[q] = x; top_c[q] = c; top_r[q] = r;
            }
        }
    }
    __syncthreads();
    const int q = threadIdx.x;
    if (q >= k || top[q] == -INFINITY) return;
    int c = top_c[q], r = top_r[q];
    for (int t = T - 1; t >= 0; t--) {
        const int code = back[(((long long)t * N + n) * C + c) * k + r], j = code >> 4;
        edges[((long long)q * T + t) * N + n] = (long long)c * NZ + j;
        c = (int)idx[c * NZ + j]; r = code & 15;
    }
}
