// CTC forward-backward over the 2L+1-state lattice, in log space, in any semiring (written by nbs/02_ctc.ipynb).
#include "semiring.cuh"
#ifndef SPT                // (ctc_alpha_beta's; the glue defines both)
#define SPT 4              // states per thread at most: the prefetched emissions live in SPT registers
#define MAX_THREADS 1024   // the largest block the glue launches ctc_alpha_beta with (float64: 512, see below)
#endif
#ifndef ABOVE
#define ABOVE 1e4          // `seqdist.checks.HUGE_LOG_PROB`, which the glue defines
#endif
#define POISON_BYTES 16    // ctc_alpha_beta's flag, before its frames (`_POISON_BYTES` of the glue: 16-byte aligned)
#ifndef SPLIT              // ctc_alpha_beta's variants (see there): the glue defines both or neither
#define SPLIT 0
#define LABELS_SMEM 0
#endif
#define PREFETCH_OTHER (SPT <= 4)  // the other half's weights of the next frame in SPT registers (see there)

__device__ __forceinline__ bool may_skip(const long long* ext, int s, int blank) {
    return s >= 2 && ext[s] != blank && ext[s] != ext[s - 2];
}

// Both recursions at once, a block a sequence: its first half computes alpha_t(s) (paths in state s after emitting
// frame t) for t = 0, 1, ..., its second half beta_t(s) (paths from s after frame t to the end, t's emission excluded)
// for t = T-1, T-2, ..., a frame each a step, one barrier a step for both. They meet in w[t, n, s]: the first to reach
// frame t stores its value, the second multiplies its own in, read a step early where a barrier stands behind the
// write (PREFETCH_OTHER: no global load on a frame's path). For odd T the backward half starts a step late. Each half
// double-buffers its frames in shared memory (the backward one keeps beta * emission) and loads its next frame's
// emissions before the barrier. Thread j owns states j, j + B, ..., at most SPT, whose emissions must fit unspilled in
// the registers the launch bounds leave (`seqdist-compile-check`): so `label` is volatile (else hoisted: two registers
// a state), the skips a bit a state, float64 512-thread blocks. Every state takes one SUM3, a missing term ZERO
// (SUM3_ALL; e^(ZERO - m) is 0: the two-term sums' bits), where blank and label states branched apart in a warp.
// `recursions`: FORWARD | BACKWARD at once; FORWARD alone (logZ only, or the first of two launches where four frames
// do not fit in shared memory); BACKWARD alone (beta multiplied into a forward launch's alpha). Variants (SPT = 4;
// 02c): SPLIT=1, a grid (N, 2), a block a recursion, beta stored in `wb`; LABELS_SMEM=1, the labels in shared memory
// (int32, after the frames); LOG2=1 (float Log), log2-scaled scores, a sum two ex2 and one lg2 (semiring.cuh).
// `delay_penalty`: k2's offset delay_penalty * (T // 2 - t) on the transitions entering a label state (odd s) in frame
// t, and on starting in state 1. PyTorch's non-finite scores: logz[n] is NaN where the forward recursion, which reads
// every emission once, reads a NaN, +inf or ABOVE or more (`HUGE_LOG_PROB`), its flag at a fixed address (the first
// POISON_BYTES of shared memory): no register, and no pass of its own (that was 1/8 of the loss on an H200).
enum { FORWARD = 1, BACKWARD = 2, SUM3_ALL = sizeof(FLOAT) == 4 || SPT <= 4 };   // (float64's SPT=16: SUM's chain: it would spill)
extern "C" __global__ void __launch_bounds__(MAX_THREADS, 1) ctc_alpha_beta(
    const FLOAT* __restrict__ lp, const long long* __restrict__ ext, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, FLOAT* __restrict__ w, FLOAT* __restrict__ logz,
    FLOAT* __restrict__ wb, int N, int C, int S_max, int blank, int recursions, double delay_penalty)
{
    extern __shared__ __align__(16) unsigned char smem[];
    volatile int* poisoned = (volatile int*)smem;       // the forward recursion's flag (see above), then the frames
    FLOAT* frames = (FLOAT*)(smem + POISON_BYTES);
    const bool both = !SPLIT && recursions == (FORWARD | BACKWARD);     // SPLIT: a block each, blockIdx.y 1 backward
    const int B = both ? blockDim.x / 2 : blockDim.x;
    const bool backward = recursions == BACKWARD || (both && threadIdx.x >= B) || (SPLIT && blockIdx.y);
    const int j = threadIdx.x - (both && backward ? B : 0);
    FLOAT* buf = frames + (both && backward ? 2 * S_max : 0);           // this recursion's two frames
    const int n = blockIdx.x, T = (int)input_lengths[n], S = 2 * (int)target_lengths[n] + 1;
    const long long* e = ext + (long long)n * S_max;
    const int h = both ? (T + 1) / 2 : T, late = both ? T % 2 : 0;   // frames t < h: alpha arrives first
    static_assert(SPT <= 32, "one bit per state in `skips`");
    const FLOAT* lp_n = lp + (long long)n * C;          // frame t of sequence n: lp_n + t * frame
    FLOAT* w_n = (SPLIT && backward ? wb : w) + (long long)n * S_max;        // SPLIT: beta apart, in wb
    const long long frame = (long long)N * C, wframe = (long long)N * S_max;
    FLOAT em[SPT], other[PREFETCH_OTHER ? SPT : 1];    // other: the first half's weights of this half's next frame
    bool other_ready = false;
    unsigned skips = 0;                                 // bit k: state j + k * B takes the skip transition
    const int t_first = backward ? T - 1 : 0;
    #pragma unroll
    for (int k = 0; k < SPT; k++) {
        const int s = j + k * B;
        if (s < S && T > 0) em[k] = lp_n[t_first * frame + e[s]];
        if (backward ? s + 2 < S && may_skip(e, s + 2, blank) : s < S && may_skip(e, s, blank)) skips |= 1u << k;
    }
    const volatile long long* label = e;                // re-read at each step, not held in registers
    volatile int* lab = (int*)(frames + (both ? 4 : 2) * S_max);        // LABELS_SMEM: the labels, after the frames
    if (LABELS_SMEM) for (int s = threadIdx.x; s < S; s += blockDim.x) lab[s] = (int)e[s];
    if (threadIdx.x == 0) *poisoned = 0;
    __syncthreads();
    for (int i = 0; i < T + late; i++) {
        const int t = backward ? T - 1 - i + late : i;
        if (t >= 0 && t < T) {                  // a half idles for one step when T is odd
            const FLOAT* prev = buf + ((i + 1) % 2) * S_max; FLOAT* cur = buf + (i % 2) * S_max;
            FLOAT* wt = w_n + t * wframe;
            const bool first = backward ? t >= h : t < h;
            const int t_next = backward ? t - 1 : t + 1;
            const FLOAT* lp_next = lp_n + t_next * frame;
            FLOAT* wt_next = w_n + t_next * wframe;
            const bool next_first = backward ? t_next >= h : t_next < h;    // the step the other half wrote it in:
            const int written = !both ? -1 : (backward ? t_next : T - 1 - t_next + late);   // (-1: a launch before)
            const bool prefetch = PREFETCH_OTHER && !SPLIT && t_next >= 0 && t_next < T && !next_first && written < i;
            const FLOAT enter = (FLOAT)(delay_penalty * TO_BASE * ((T >> 1) - (backward ? t + 1 : t)));   // entering a label
            #pragma unroll
            for (int k = 0; k < SPT; k++) {
                const int s = j + k * B;
                if (s >= S) break;
                FLOAT v;
                if (!backward) {
                    if (t == 0) v = s == 0 ? ONE : (s == 1 ? MUL(ONE, enter) : ZERO);
                    else if (SUM3_ALL)                      // every state one SUM3, ZERO for a missing term
                        v = SUM3(prev[s], s >= 1 ? (s & 1 ? MUL(prev[s - 1], enter) : prev[s - 1]) : (FLOAT)ZERO,
                                 skips >> k & 1u ? MUL(prev[s - 2], enter) : (FLOAT)ZERO);
                    else {                                  // into a label (odd s) from s - 1 or s - 2: + enter
                        v = prev[s];
                        if (s >= 1) v = SUM(v, s & 1 ? MUL(prev[s - 1], enter) : prev[s - 1]);
                        if (skips >> k & 1u) v = SUM(v, MUL(prev[s - 2], enter));
                    }
                    cur[s] = v = EMIT(v, em[k]);            // alpha_t(s)
                    if (!(em[k] < (FLOAT)ABOVE)) *poisoned = 1;   // (each emission passes here once)
                } else {
                    if (t == T - 1) v = s >= S - 2 ? ONE : ZERO;
                    else if (SUM3_ALL)
                        v = SUM3(prev[s], s + 1 < S ? (s & 1 ? prev[s + 1] : MUL(prev[s + 1], enter)) : (FLOAT)ZERO,
                                 skips >> k & 1u ? MUL(prev[s + 2], enter) : (FLOAT)ZERO);
                    else {                                  // into a label (s + 1 if s is even, s + 2) in frame t + 1
                        v = prev[s];
                        if (s + 1 < S) v = SUM(v, s & 1 ? prev[s + 1] : MUL(prev[s + 1], enter));
                        if (skips >> k & 1u) v = SUM(v, MUL(prev[s + 2], enter));
                    }
                    cur[s] = EMIT(v, em[k]);                // beta_t(s) * emission: what frame t - 1 reads
                }
                wt[s] = SPLIT || first ? NATURAL(v) : MUL(PREFETCH_OTHER && other_ready ? other[k] : wt[s], NATURAL(v));
                if (t_next >= 0 && t_next < T) em[k] = lp_next[LABELS_SMEM ? lab[s] : label[s]];
                if (prefetch) other[k] = wt_next[s];
            }
            other_ready = prefetch;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0 && !backward) {
        const FLOAT* last = buf + ((T + 1) % 2) * S_max;    // the forward recursion's frame T - 1
        const FLOAT z = T == 0 ? (S == 1 ? ONE : ZERO) : (S > 1 ? SUM(last[S - 1], last[S - 2]) : last[0]);
        logz[n] = *poisoned ? (FLOAT)INFINITY - (FLOAT)INFINITY       // NaN
                  : z > (FLOAT)-1e30 ? NATURAL(z) : -INFINITY;         // ZERO is finite (-1e38): infeasible
    }
}

// Posteriors from the state weights w (w * wb with SPLIT=1): out[t, n, k] -= posterior, k the state (by_state) or its
// label. Log: exp(w - log sum_s exp(w)), normalised by the frame's total (Z in exact arithmetic), which cancels the
// rounding a frame's alpha and beta share (float32, T = 2000, L = 450: 2.8e-4 where logZ gave 4e-3). Max: 1 at the
// frame's first best state. Nothing where logz = -inf. A thread a (t, n), its states in order: no atomics.
struct PosteriorFrame {   // frame i = t N + n as both posteriors' kernels read it: weights (SPLIT: beta apart), labels,
    const FLOAT *wt, *bt; const long long* e; FLOAT* o; int S;             // output row, states
    __device__ FLOAT weight(int s) const { return SPLIT ? MUL(wt[s], bt[s]) : wt[s]; }
};

// Frame i's PosteriorFrame in f; false where it has none (past its input length, or no path: logz -inf).
__device__ __forceinline__ bool posterior_frame(
    long long i, const FLOAT* w, const FLOAT* wb, const long long* ext, const long long* input_lengths,
    const long long* target_lengths, const FLOAT* logz, FLOAT* out, int N, int K, int S_max, PosteriorFrame& f)
{
    const int t = (int)(i / N), n = (int)(i % N);
    if (t >= input_lengths[n] || logz[n] == -INFINITY) return false;
    f.wt = w + i * S_max; f.bt = SPLIT ? wb + i * S_max : nullptr; f.e = ext + (long long)n * S_max; f.o = out + i * K;
    f.S = 2 * (int)target_lengths[n] + 1;
    return true;
}

extern "C" __global__ void ctc_posteriors(
    const FLOAT* __restrict__ w, const FLOAT* __restrict__ wb, const long long* __restrict__ ext,
    const long long* __restrict__ input_lengths, const long long* __restrict__ target_lengths, const FLOAT* __restrict__ logz,
    FLOAT* __restrict__ out, int T_max, int N, int K, int S_max, int by_state, int use_max)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T_max * N) return;   // no barrier in this kernel, so an early exit is safe
    PosteriorFrame f;
    if (!posterior_frame(i, w, wb, ext, input_lengths, target_lengths, logz, out, N, K, S_max, f)) return;
    if (use_max) {
        int best = 0;
        for (int s = 1; s < f.S; s++) if (f.weight(s) > f.weight(best)) best = s;
        f.o[by_state ? best : f.e[best]] -= 1;
    } else {                                       // normalised by the frame's own total (see above)
        FLOAT m = f.weight(0), z = 0;
        for (int s = 1; s < f.S; s++) m = f.weight(s) > m ? f.weight(s) : m;
        for (int s = 0; s < f.S; s++) z += exp(f.weight(s) - m);
        const FLOAT frame_logz = m + log(z);
        for (int s = 0; s < f.S; s++) f.o[by_state ? s : f.e[s]] -= exp(f.weight(s) - frame_logz);
    }
}

// ctc_posteriors with a warp a frame (SEQDIST_CTC_POSTERIORS=warp): lanes read the states side by side (coalesced),
// max and total by shuffles. By label no two lanes add into one class (deterministic): the blank's states are summed by
// shuffles, each label's by the lane of its first state (links[2 s] == s) along links[2 s + 1] (next, -1 none).
extern "C" __global__ void ctc_posteriors_warp(
    const FLOAT* __restrict__ w, const FLOAT* __restrict__ wb, const long long* __restrict__ ext,
    const int* __restrict__ links, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, const FLOAT* __restrict__ logz, FLOAT* __restrict__ out, int T_max,
    int N, int K, int S_max, int by_state, int use_max)
{
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;     // the warp's frame
    const int lane = threadIdx.x % 32;
    if (i >= (long long)T_max * N) return;    // (the whole warp: no shuffle is left waiting)
    PosteriorFrame f;
    if (!posterior_frame(i, w, wb, ext, input_lengths, target_lengths, logz, out, N, K, S_max, f)) return;
    const int S = f.S; const long long* e = f.e; FLOAT* o = f.o;
    const auto weight = [&](int s) { return f.weight(s); };
    if (use_max) {
        int best = -1;
        FLOAT top = 0;
        for (int s = lane; s < S; s += 32) if (best < 0 || weight(s) > top) { top = weight(s); best = s; }
        for (int d = 16; d > 0; d /= 2) {          // the larger, and of equals the first state
            const FLOAT top2 = __shfl_xor_sync(0xffffffffu, top, d);
            const int best2 = __shfl_xor_sync(0xffffffffu, best, d);
            if (best2 >= 0 && (best < 0 || top2 > top || (top2 == top && best2 < best))) { top = top2; best = best2; }
        }
        if (lane == 0) o[by_state ? best : e[best]] -= 1;
        return;
    }
    FLOAT m = -INFINITY, z = 0;
    for (int s = lane; s < S; s += 32) m = max2(m, weight(s));
    for (int d = 16; d > 0; d /= 2) m = max2(m, __shfl_xor_sync(0xffffffffu, m, d));
    for (int s = lane; s < S; s += 32) z += exp(weight(s) - m);
    for (int d = 16; d > 0; d /= 2) z += __shfl_xor_sync(0xffffffffu, z, d);
    const FLOAT frame_logz = m + log(z);
    if (by_state) { for (int s = lane; s < S; s += 32) o[s] -= exp(weight(s) - frame_logz); return; }
    FLOAT blank = 0;
    for (int s = 2 * lane; s < S; s += 64) blank += exp(weight(s) - frame_logz);
    for (int d = 16; d > 0; d /= 2) blank += __shfl_xor_sync(0xffffffffu, blank, d);
    if (lane == 0) o[e[0]] -= blank;
    const int* l = links + (i % N) * S_max * 2;
    for (int s = 2 * lane + 1; s < S; s += 64) {
        if (l[2 * s] != s) continue;               // not the label's first state: its first state's lane adds it
        FLOAT p = 0;
        for (int q = s; q >= 0; q = l[2 * q + 1]) p += exp(weight(q) - frame_logz);
        o[e[s]] -= p;
    }
}

// A frame's factor in the gradient (`_frame_scales`): -grad_logz[n] in frames t < input_lengths[n], else 0; NaN where
// logZ is NaN (never zeroed) or infinite (no path) unless zero_infinity (0). Computed where used: no (T, N) tensor.
__device__ __forceinline__ FLOAT frame_scale(const FLOAT* grad_logz, const FLOAT* logz, const long long* input_lengths,
                                             int t, int n, int zero_infinity)
{
    if (t >= input_lengths[n]) return (FLOAT)0;
    const FLOAT z = logz[n], nan = (FLOAT)INFINITY - (FLOAT)INFINITY;
    if (z != z) return nan;
    if (z == (FLOAT)INFINITY || z == -(FLOAT)INFINITY) return zero_infinity ? (FLOAT)0 : nan;
    return -grad_logz[n];
}

// The labels' gradient: grad[t, n, c] = scale * (exp(lp[t, n, c]) (torch_grad: PyTorch's convention) + minus_posteriors
// (of the labels, if given)), scale the frame's `frame_scale`, 0 where it is 0 (past an input length, the padding may
// hold NaN). A thread an element: one pass over (T, N, C), where PyTorch ops (exp, add, mul) took three.
extern "C" __global__ void ctc_grad(const FLOAT* __restrict__ lp, const FLOAT* __restrict__ minus_posteriors,
                                    const FLOAT* __restrict__ grad_logz, const FLOAT* __restrict__ logz,
                                    const long long* __restrict__ input_lengths, FLOAT* __restrict__ grad, long long rows,
                                    int N, int C, int torch_grad, int zero_infinity)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * C) return;
    const long long row = i / C;
    const FLOAT s = frame_scale(grad_logz, logz, input_lengths, (int)(row / N), (int)(row % N), zero_infinity);
    FLOAT v = torch_grad ? exp(lp[i]) : (FLOAT)0;
    if (minus_posteriors) v += minus_posteriors[i];
    grad[i] = s == (FLOAT)0 ? (FLOAT)0 : s * v;
}

// out[t, n, label of s] += scale * minus_posteriors[t, n, s] over each valid frame's states s (scale its
// `frame_scale`), in state order, a thread a (t, n): deterministic, where scatter_add_ adds with atomics in any order.
extern "C" __global__ void ctc_states_to_labels(
    const FLOAT* __restrict__ minus_posteriors, const long long* __restrict__ ext, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, const FLOAT* __restrict__ grad_logz, const FLOAT* __restrict__ logz,
    FLOAT* __restrict__ out, int T_max, int N, int C, int S_max, int zero_infinity)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T_max * N) return;
    const int t = (int)(i / N), n = (int)(i % N);
    if (t >= input_lengths[n]) return;
    const int S = 2 * (int)target_lengths[n] + 1;
    const FLOAT scale = frame_scale(grad_logz, logz, input_lengths, t, n, zero_infinity);
    const FLOAT* p = minus_posteriors + i * S_max;
    const long long* e = ext + (long long)n * S_max;
    FLOAT* o = out + i * C;
    for (int s = 0; s < S; s++) o[e[s]] += scale * p[s];
}

// The CUDA backend's `padded_targets` and `interleave_blanks` in one launch (~25 PyTorch ops did it): ext (N, W), the
// blank at even s and past the length, label (s - 1) / 2 at odd s, from padded targets (N, width) or concatenated ones
// (`concat`: sequence n's at starts[n], `total` in all). `check`'s bits: the lengths (1) and labels (2) on the device
// are checked, ok[k] = 0 where check k fails (all write 0: no race). `links` (N, W, 2): each label state's first and
// next state of the same label (-1 none; `ctc_posteriors_warp`; L reads a state). A thread an element.
extern "C" __global__ void ctc_prepare(
    const long long* __restrict__ targets, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, const long long* __restrict__ starts, long long* __restrict__ ext,
    bool* __restrict__ ok, int* __restrict__ links, int N, int W, int T, int C, int blank, int concat, int width,
    long long total, int check)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * W) return;
    const int n = (int)(i / W), s = (int)(i % W), u = (s - 1) / 2;
    const long long L = target_lengths[n], at = concat ? (s % 2 ? starts[n] + u : 0) : (long long)n * width + u;
    long long label = blank;
    if (s % 2 == 1 && u < L && (concat ? at >= 0 && at < total : u < width)) {      // (else a length check fails)
        label = targets[at];
        if ((check & 2) && (label < 0 || label >= C || label == blank)) ok[4] = false;
    }
    ext[i] = label;
    if (links) {                                    // (ctc_posteriors_warp's) the label's first state, and the next one
        int first = s, next = -1;
        if (s % 2 == 1 && u < L)
            for (long long v = 0; v < L; v++) {
                const long long at_v = concat ? starts[n] + v : (long long)n * width + v;
                if ((concat ? at_v >= 0 && at_v < total : v < width) && targets[at_v] == label) {
                    const int q = 2 * (int)v + 1;
                    if (q < first) first = q;
                    if (q > s && next < 0) next = q;
                }
            }
        links[2 * i] = first; links[2 * i + 1] = next;
    }
    if ((check & 1) && s == 0) {
        const long long il = input_lengths[n];
        if (il < 0 || il > T) ok[0] = false;
        if (L < 0) ok[1] = false;
        if (!concat && L > width) ok[2] = false;
        if (concat && n == N - 1 && starts[n] + L != total) ok[3] = false;
    }
}
