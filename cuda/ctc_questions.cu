// The lattice questions over the CTC lattice (written by nbs/02b_ctc_questions.ipynb).
#include "semiring.cuh"

// The lattice questions (seqdist.core's algebras, ALG a macro: ALG_ENTROPY or ALG_KL) over the CTC lattice, one block
// per sequence, as the CPU kernel `_ctc_alg_cpu` computes them: the forward recursion keeps the state (p, q, c) of
// every (frame, state) in `fwd` (N, T_max, 3, S_max + 4: two zero states pad each end of a row), out[n] = (log Z_p,
// log Z_q, accumulator); with `with_grad`, the backward recursion of the same algebra runs in `back` (N, 6, S_max + 4:
// the states of frame t, and of frame t + 1 times its emissions) and at each frame the closed-form gradient of the
// accumulator w.r.t. each state's emission (`gs`, N x 2 x S_max, p's and q's) is summed into grad_p[t, n, label] (and
// grad_q) by the thread that owns the label's first state in the frame's band, in the states' order: no atomics, and
// the CPU kernel's order of addition. A label's states are found along `links` (N x 2 x S_max: each label state's
// next and previous state of the same label, -1: none; made once a sequence), the blank's two apart. Thread j owns states j, j + blockDim.x, ...; one barrier per frame and pass. Rows live in global
// memory (a block reads what its own threads wrote before the barrier). `split` (with `with_grad`): block (n, 1) runs
// the backward recursion at the same time as the forward, every frame kept in `back` (N, T_max, 3, S_max + 4), and
// `ctc_divergence_grad` takes the gradients after, a thread a (frame, sequence, label): the same sums.
#ifndef ALG
#define ALG 1
#endif
__device__ __forceinline__ AlgState alg_at(const double* row, int stride, int i) {
    AlgState x; x.p = row[i]; x.q = row[stride + i]; x.c = row[2 * stride + i]; return x;
}
__device__ __forceinline__ void alg_put(double* row, int stride, int i, AlgState x) {
    row[i] = x.p; row[stride + i] = x.q; row[2 * stride + i] = x.c;
}
__device__ __forceinline__ AlgState alg_zero() { AlgState z; z.p = -INFINITY; z.q = -INFINITY; z.c = 0.0; return z; }
// The closed-form gradient of the accumulator w.r.t. state st's emission at a frame, from its forward row f and its
// backward row b (components p, q, c, each W long; state st at index st + 2).
__device__ __forceinline__ void ctc_state_grad(const double* f, const double* b, int W, int st, double zp, double zq,
                                               double total, double* gp, double* gq) {
    const double lmp = f[st + 2] + b[st + 2] - zp;
    const double mp = lmp > -INFINITY ? exp(lmp) : 0.0;
    if (ALG == ALG_ENTROPY) {
        *gp = mp > 0.0 ? -mp * (lmp - f[2 * W + st + 2] - b[2 * W + st + 2] + total) : 0.0;
        *gq = 0.0;
    } else {
        const double lmq = f[W + st + 2] + b[W + st + 2] - zq;
        const double mq = lmq > -INFINITY ? exp(lmq) : 0.0;
        *gp = mp > 0.0 ? mp * (lmp - lmq + f[2 * W + st + 2] + b[2 * W + st + 2] - total) : 0.0;
        *gq = mq - mp;
    }
}
// Frame t's band of states: those on a path of T frames (S states).
__device__ __forceinline__ int band_lo(int S, int T, int t) { return max(0, S - 2 * (T - t)); }
__device__ __forceinline__ int band_hi(int S, int t) { return min(S - 1, 2 * t + 1); }
// State k's backward state at a frame (its row) times the frame's emission at `at` + its label (zero outside the band).
__device__ __forceinline__ AlgState ctc_times_emission(const double* row, int W, int k, int lo, int hi, const long long* e,
                                                       const FLOAT* lp, const FLOAT* lq, long long at) {
    AlgState x = alg_zero();
    if (k >= lo && k <= hi) {
        x = alg_at(row, W, k + 2);
        x.p += (double)lp[at + e[k]];
        if (ALG == ALG_KL) x.q += (double)lq[at + e[k]];
    }
    return x;
}

extern "C" __global__ void ctc_divergence(
    const FLOAT* __restrict__ lp, const FLOAT* __restrict__ lq, const long long* __restrict__ ext,
    const long long* __restrict__ input_lengths, const long long* __restrict__ target_lengths, double* __restrict__ fwd,
    double* __restrict__ back, double* __restrict__ gs, int* __restrict__ links, double* __restrict__ out,
    FLOAT* __restrict__ grad_p, FLOAT* __restrict__ grad_q, int N, int C, int S_max, int T_max, int blank, int with_grad,
    double above, int split)
{
    const int n = blockIdx.x, B = blockDim.x, j = threadIdx.x, backward = blockIdx.y;   // (block (n, 1): split's)
    const int T = (int)input_lengths[n], L = (int)target_lengths[n], S = 2 * L + 1, W = S_max + 4;
    const long long* e = ext + (long long)n * S_max;
    const long long frame = (long long)N * C;
    if (above > 0 && !backward) {   // PyTorch's NaN: a NaN, +inf or `above` among the emissions the lattice reads (every frame
        __shared__ int poisoned;                            // and state, in or out of the band) makes the sequence's
        if (j == 0) poisoned = 0;                           // value and its gradients NaN (`poisoned_sequences`)
        __syncthreads();
        for (int t = 0; t < T; t++)
            for (int st = j; st < S; st += B) {
                const long long at = t * frame + n * (long long)C + e[st];
                if (!((double)lp[at] < above) || (ALG == ALG_KL && !((double)lq[at] < above))) poisoned = 1;
            }
        __syncthreads();
        if (poisoned) {
            const double nan = (double)INFINITY - (double)INFINITY;
            if (j == 0) { out[3 * n] = nan; out[3 * n + 1] = nan; out[3 * n + 2] = nan; }
            if (with_grad)
                for (long long i = j; i < (long long)T_max * C; i += B) {
                    grad_p[i / C * frame + n * (long long)C + i % C] = (FLOAT)nan;
                    if (ALG == ALG_KL) grad_q[i / C * frame + n * (long long)C + i % C] = (FLOAT)nan;
                }
            return;                                         // (the whole block)
        }
    }
    int repeats = 0;                                        // frames needed: labels, and a blank between equal ones
    for (int k = 1; k < L; k++) repeats += e[2 * k + 1] == e[2 * k - 1];
    if (T < L + repeats || T == 0) {                        // infeasible (no path), or no frames (the empty path)
        if (j == 0) { const double z = T == 0 && T >= L + repeats ? 0.0 : -INFINITY;
                      out[3 * n] = z; out[3 * n + 1] = z; out[3 * n + 2] = 0.0; }
        return;                                             // (the whole block: no barrier is skipped by some only)
    }
    int* nxt = links + (long long)n * 2 * S_max;            // (read after the forward recursion's barriers)
    int* prv = nxt + S_max;
    if (with_grad && backward == split)                     // (the block that runs the backward recursion)
        for (int s = 2 * j + 1; s < S; s += 2 * B) {        // label states: the next and previous of the same label
            int p = s - 2, q = s + 2;
            while (p >= 0 && e[p] != e[s]) p -= 2;
            while (q < S && e[q] != e[s]) q += 2;
            prv[s] = p; nxt[s] = q < S ? q : -1;
        }
    if (backward) {                                         // split: the backward recursion, every frame kept
        double* Bn = back + (long long)n * T_max * 3 * W;   // row t: Bn + t * 3 * W
        for (int s = j; s < W; s += B) {
            AlgState x = alg_zero();
            if (s == S + 1 || (S > 1 && s == S)) { x.p = 0.0; x.q = ALG == ALG_KL ? 0.0 : -INFINITY; }
            alg_put(Bn + (long long)(T - 1) * 3 * W, W, s, x);
        }
        for (int t = T - 2; t >= 0; t--) {
            __syncthreads();                                // frame t + 1 is written
            const double* nx = Bn + (long long)(t + 1) * 3 * W;
            const int lo = band_lo(S, T, t), hi = band_hi(S, t), lo1 = band_lo(S, T, t + 1), hi1 = band_hi(S, t + 1);
            const long long at = (t + 1) * frame + n * (long long)C;
            for (int s = j; s < W; s += B) {                // state st sums st, st + 1 and (a skip) st + 2 of frame t + 1
                const int st = s - 2;
                AlgState x = alg_zero();
                if (st >= lo && st <= hi) {
                    const bool skip = st + 2 < S && e[st + 2] != blank && e[st + 2] != e[st];
                    x = alg_plus3<ALG>(ctc_times_emission(nx, W, st, lo1, hi1, e, lp, lq, at),
                                       ctc_times_emission(nx, W, st + 1, lo1, hi1, e, lp, lq, at),
                                       skip ? ctc_times_emission(nx, W, st + 2, lo1, hi1, e, lp, lq, at) : alg_zero());
                }
                alg_put(Bn + (long long)t * 3 * W, W, s, x);
            }
        }
        return;
    }
    double* F = fwd + (long long)n * T_max * 3 * W;         // row t: F + t * 3 * W, components p, q, c
    for (int s = j; s < W; s += B) {                        // frame 0: a blank or the first label
        const int st = s - 2;
        AlgState x = alg_zero();
        if (st >= 0 && st < 2 && st < S) {
            x.p = (double)lp[n * (long long)C + e[st]];
            x.q = ALG == ALG_KL ? (double)lq[n * (long long)C + e[st]] : -INFINITY;
        }
        alg_put(F, W, s, x);
    }
    for (int t = 1; t < T; t++) {
        __syncthreads();
        const double* prev = F + (long long)(t - 1) * 3 * W;
        double* cur = F + (long long)t * 3 * W;
        const int lo = band_lo(S, T, t), hi = band_hi(S, t);
        for (int s = j; s < W; s += B) {
            const int st = s - 2;
            AlgState x = alg_zero();
            if (st >= lo && st <= hi) {
                AlgState c = alg_at(prev, W, s - 2);
                if (!(st >= 2 && e[st] != blank && e[st] != e[st - 2])) c = alg_zero();
                x = alg_plus3<ALG>(alg_at(prev, W, s), alg_at(prev, W, s - 1), c);
                x.p += (double)lp[t * frame + n * (long long)C + e[st]];
                if (ALG == ALG_KL) x.q += (double)lq[t * frame + n * (long long)C + e[st]];
            }
            alg_put(cur, W, s, x);
        }
    }
    __syncthreads();
    const double* last = F + (long long)(T - 1) * 3 * W;
    const AlgState fin = S == 1 ? alg_at(last, W, S + 1)
                                : alg_plus3<ALG>(alg_at(last, W, S + 1), alg_at(last, W, S), alg_zero());
    if (j == 0) { out[3 * n] = fin.p; out[3 * n + 1] = ALG == ALG_KL ? fin.q : fin.p; out[3 * n + 2] = fin.c; }
    if (!with_grad || split || fin.p == -INFINITY || (ALG == ALG_KL && fin.q == -INFINITY)) return;
    const double zp = fin.p, zq = ALG == ALG_KL ? fin.q : fin.p, total = fin.c;
    double* cb = back + (long long)n * 6 * W;               // frame t's backward states
    double* nb = cb + 3 * W;                                // frame t + 1's, times its emissions
    double* gp = gs + (long long)n * 2 * S_max;
    double* gq = gp + S_max;
    for (int s = j; s < W; s += B) {
        AlgState x = alg_zero();
        if (s == S + 1 || (S > 1 && s == S)) { x.p = 0.0; x.q = ALG == ALG_KL ? 0.0 : -INFINITY; }
        alg_put(cb, W, s, x);
    }
    for (int t = T - 1; t >= 0; t--) {
        const int lo = band_lo(S, T, t), hi = band_hi(S, t);
        __syncthreads();
        if (t < T - 1)
            for (int s = j; s < W; s += B) {                // state st sums st, st + 1 and (a skip) st + 2 of frame t + 1
                const int st = s - 2;
                AlgState x = alg_zero();
                if (st >= lo && st <= hi) {
                    AlgState c = alg_at(nb, W, s + 2);
                    if (!(st + 2 < S && e[st + 2] != blank && e[st + 2] != e[st])) c = alg_zero();
                    x = alg_plus3<ALG>(alg_at(nb, W, s), alg_at(nb, W, s + 1), c);
                }
                alg_put(cb, W, s, x);
            }
        __syncthreads();
        const double* f = F + (long long)t * 3 * W;
        for (int st = lo + j; st <= hi; st += B)            // the gradient at each node of the frame
            ctc_state_grad(f, cb, W, st, zp, zq, total, gp + st, gq + st);
        __syncthreads();
        FLOAT* rp = grad_p + t * frame + n * (long long)C;
        FLOAT* rq = grad_q + t * frame + n * (long long)C;
        for (int st = lo + j; st <= hi; st += B) {          // each label's states summed by the owner of its first
            if ((st & 1 ? prv[st] : st - 2) >= lo) continue;  // (the blank's states: every even one)
            double sp = 0.0, sq = 0.0;
            for (int s2 = st; s2 >= 0 && s2 <= hi; s2 = st & 1 ? nxt[s2] : s2 + 2) {
                sp += gp[s2];
                if (ALG == ALG_KL) sq += gq[s2];
            }
            rp[e[st]] = (FLOAT)sp;
            if (ALG == ALG_KL) rq[e[st]] = (FLOAT)sq;
        }
        if (t == 0) break;
        __syncthreads();
        for (int s = j; s < W; s += B) {                    // frame t times its emissions, for frame t - 1
            const int st = s - 2;
            AlgState x = alg_zero();
            if (st >= lo && st <= hi) {
                x = alg_at(cb, W, s);
                x.p += (double)lp[t * frame + n * (long long)C + e[st]];
                if (ALG == ALG_KL) x.q += (double)lq[t * frame + n * (long long)C + e[st]];
            }
            alg_put(nb, W, s, x);
        }
    }
}

// `split`'s gradients: thread (t, n, st) for the first state st of each label of sequence n's target (the blank's:
// state 0) sums the gradient at that label's states in frame t's band, in the states' order, into grad_p[t, n, label]
// (and grad_q), as the fused kernel's owner of the label's first state in the band does. Nothing is written for a
// sequence with no path, or a poisoned one (ctc_divergence wrote its NaN gradients).
extern "C" __global__ void ctc_divergence_grad(
    const double* __restrict__ fwd, const double* __restrict__ back, const long long* __restrict__ ext,
    const int* __restrict__ links, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, const double* __restrict__ out, FLOAT* __restrict__ grad_p,
    FLOAT* __restrict__ grad_q, int N, int C, int S_max, int T_max)
{
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)T_max * N * S_max) return;
    const int st = (int)(id % S_max), n = (int)(id / S_max % N), t = (int)(id / S_max / N);
    const int T = (int)input_lengths[n], S = 2 * (int)target_lengths[n] + 1, W = S_max + 4;
    if (t >= T || st >= S) return;
    const double zp = out[3 * n], zq = out[3 * n + 1], total = out[3 * n + 2];
    if (!(zp > -INFINITY) || !(zq > -INFINITY)) return;     // (also NaN: poisoned)
    const int* nxt = links + (long long)n * 2 * S_max;
    if (st & 1 ? nxt[S_max + st] >= 0 : st > 0) return;     // not its label's first state
    const long long* e = ext + (long long)n * S_max;
    const double* f = fwd + ((long long)n * T_max + t) * 3 * W;
    const double* b = back + ((long long)n * T_max + t) * 3 * W;
    const int lo = band_lo(S, T, t), hi = band_hi(S, t);
    double sp = 0.0, sq = 0.0, gp, gq;
    bool any = false;
    for (int s2 = st; s2 >= 0 && s2 <= hi; s2 = st & 1 ? nxt[s2] : s2 + 2) {
        if (s2 < lo) continue;
        ctc_state_grad(f, b, W, s2, zp, zq, total, &gp, &gq);
        sp += gp;
        if (ALG == ALG_KL) sq += gq;
        any = true;
    }
    if (!any) return;
    const long long at = (long long)t * N * C + n * (long long)C + e[st];
    grad_p[at] = (FLOAT)sp;
    if (ALG == ALG_KL) grad_q[at] = (FLOAT)sq;
}

// Backward sampling over the loss's forward scores (`ctc_alpha_beta`'s alpha, log space, T_max x N x S_max, in
// float64): thread i * N + n walks sample i of sequence n back from frame T - 1, picking a final state (the last
// blank, the last label) and then at each frame a predecessor of the state after it (stay, move, skip) in proportion
// to exp(alpha), with the uniform u[i, n, t], as `pick_log3` (semiring.cuh) picks: the CPU kernel's candidates in its
// order, so the same uniforms give the same samples. states[i, n, t] gets the state; nothing is written for a
// sequence with no path (log Z -inf) or no frames.

extern "C" __global__ void ctc_sample(
    const double* __restrict__ alpha, const long long* __restrict__ ext, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, const double* __restrict__ u, const double* __restrict__ logz,
    long long* __restrict__ states, int N, int S_max, int T_max, int n_samples, int blank)
{
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)n_samples * N) return;
    const int n = (int)(id % N);
    const int T = (int)input_lengths[n], S = 2 * (int)target_lengths[n] + 1;
    if (T == 0 || !(logz[n] > -INFINITY)) return;
    const long long* e = ext + (long long)n * S_max;
    const double* ui = u + id * T_max;                                  // u[i, n, :]
    long long* si = states + id * T_max;
    #define ALPHA(t, s) ((s) >= 0 ? alpha[((long long)(t) * N + n) * S_max + (s)] : -INFINITY)
    int s = S - 1 - pick_log3(ALPHA(T - 1, S - 1), ALPHA(T - 1, S - 2), -INFINITY, ui[T - 1]);
    si[T - 1] = s;
    for (int t = T - 2; t >= 0; t--) {
        const bool skip = s >= 2 && e[s] != blank && e[s] != e[s - 2];
        s -= pick_log3(ALPHA(t, s), ALPHA(t, s - 1), skip ? ALPHA(t, s - 2) : -INFINITY, ui[t]);
        si[t] = s;
    }
    #undef ALPHA
}

// The k best paths (KMax(k), k <= 16), one block per sequence, as the CPU kernel `_ctc_kbest_cpu`: each state keeps
// the k best scores into it, sorted, merged from its predecessors' lists (stay, move, skip: `merge_top3`, ties to the
// earlier list), and for each (frame, state, rank) a code 16 * list + rank of where it came from (`back`, int8,
// N x T_max x S_max x k); two frames of values in `vals` (N x 2 x (S_max + 2) x k, index s + 2 is state s). Then thread
// r < k walks rank r back from the final states: states[r, n, t] and best[r, n] (-inf where fewer than r + 1 exist).

extern "C" __global__ void ctc_kbest(
    const FLOAT* __restrict__ lp, const long long* __restrict__ ext, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, double* __restrict__ vals, signed char* __restrict__ back,
    double* __restrict__ best, long long* __restrict__ states, int N, int C, int S_max, int T_max, int blank, int k)
{
    const int n = blockIdx.x, B = blockDim.x, j = threadIdx.x;
    const int T = (int)input_lengths[n], L = (int)target_lengths[n], S = 2 * L + 1, W = S_max + 2;
    const long long* e = ext + (long long)n * S_max;
    for (int r = j; r < k; r += B) best[(long long)r * N + n] = -INFINITY;
    int repeats = 0;
    for (int m = 1; m < L; m++) repeats += e[2 * m + 1] == e[2 * m - 1];
    if (T < L + repeats) return;                            // no path (the whole block returns)
    if (T == 0) { if (j == 0) best[n] = 0.0; return; }     // the empty path
    __shared__ double none[16], finals[16];                 // (shared, not per-thread arrays: no local memory)
    __shared__ signed char code[16];
    if (j < 16) none[j] = -INFINITY;
    double* V = vals + (long long)n * 2 * W * k;            // frame t's row: V + (t % 2) * W * k; state s at (s + 2) * k
    signed char* bk = back + (long long)n * T_max * S_max * k;
    const long long frame = (long long)N * C;
    for (int i = j; i < 2 * W * k; i += B) V[i] = -INFINITY;
    __syncthreads();
    if (j == 0) { V[2 * k] = (double)lp[n * (long long)C + e[0]];
                  if (S > 1) V[3 * k] = (double)lp[n * (long long)C + e[1]]; }
    for (int t = 1; t < T; t++) {
        __syncthreads();
        const double* prev = V + ((t - 1) % 2) * W * k;
        double* cur = V + (t % 2) * W * k;
        const int lo = band_lo(S, T, t), hi = band_hi(S, t);
        for (int s = j; s < S; s += B) {
            double* o = cur + (s + 2) * k;
            if (s < lo || s > hi) { for (int r = 0; r < k; r++) o[r] = -INFINITY; continue; }
            const bool skip = s >= 2 && e[s] != blank && e[s] != e[s - 2];
            merge_top3(k, prev + (s + 2) * k, prev + (s + 1) * k, skip ? prev + s * k : none, o,
                       bk + ((long long)t * S_max + s) * k);
            const double x = (double)lp[t * frame + n * (long long)C + e[s]];
            for (int r = 0; r < k; r++) o[r] += x;
        }
    }
    __syncthreads();
    const double* last = V + ((T - 1) % 2) * W * k;
    if (j == 0) merge_top3(k, last + (S + 1) * k, S > 1 ? last + S * k : none, none, finals, code);
    __syncthreads();
    const int r = j;
    if (r >= k || !(finals[r] > -INFINITY)) return;
    best[(long long)r * N + n] = finals[r];
    int s = S - 1 - code[r] / 16, rank = code[r] % 16;
    long long* out = states + ((long long)r * N + n) * T_max;
    for (int t = T - 1; t >= 0; t--) {
        out[t] = s;
        if (t > 0) { const int c = bk[((long long)t * S_max + s) * k + rank]; s -= c / 16; rank = c % 16; }
    }
}
