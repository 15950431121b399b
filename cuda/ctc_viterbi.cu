// CTC's best path by the Viterbi recursion, checkpointed and tiled (written by nbs/02a_ctc_align.ipynb).
#include "semiring.cuh"

// The skip into state s from s - 2: into a label unlike the label before it (a copy of ctc.cu's).
__device__ __forceinline__ bool may_skip(const long long* ext, int s, int blank) {
    return s >= 2 && ext[s] != blank && ext[s] != ext[s - 2];
}

// The best path's state at each frame (forced alignment), at any length: the max recursion keeping for each (frame,
// state) which predecessor won (0 stay, 1 move, 2 skip: the first of equals, as the CPU kernel), then a walk back from
// the best final state. Scores add in double, in the CPU kernel's order, so both find the same path even among equal
// ones. states[n, t] is left as is for an infeasible sequence and past its input length.
//
// Memory bounded by checkpoints, as `_viterbi_checkpointed_cpu`: with k = `every`, a sequence of T frames has
// J = max(1, ceil((T - 1) / k)) segments, segment j the frames j k + 1 ... min(j k + k, T - 1). A first launch
// (`segment` = -1, only when some sequence has J > 1) runs the recursion from frame 0 and keeps the scores of frames
// k, 2k, ... (J - 1) k in `rows` (J - 1, N, S_max); then one launch per segment, last to first, starts from its row
// (segment 0: from frame 0), keeps its k frames' back-pointers in `back` (k, N, S_max) and walks back from the state
// where the later segment's walk arrived (the last segment: from the best final state, `last` (N, 2): the scores of
// states S - 2 and S - 1 at frame T - 1). With J = 1 for every sequence (k >= T - 1) that is one launch.
//
// Long targets split across blocks: block b of a sequence holds states b * tile ... b * tile + tile - 1 (two frames
// in shared memory, with two slots below for states b * tile - 2 and - 1 of the block before). A state's predecessors
// are itself and the two below it, so block b needs only block b - 1's top two states of the frame before: block b - 1
// publishes them for each frame in `edges` (N, tiles, frames, 2) and counts the frames published in its `progress`;
// block b waits on that count. It never waits on a block above it, so there is no cycle; and blocks take their
// (sequence, tile) from a ticket counter in arrival order (not from blockIdx, whose blocks may be scheduled in any
// order), so the block waited on has started already and is never waiting on one that has not: no deadlock, no host
// sync, whatever the number of blocks resident. The emulator runs blocks one after another in the same ticket order,
// so a wait there is satisfied at once (it asserts so). The last block of a sequence to finish a segment (an atomic
// count in `done`) walks it back. `sync` (zeroed for each launch): the ticket, then progress (N x tiles), then done (N).
extern "C" __global__ void ctc_viterbi(
    const FLOAT* __restrict__ lp, const long long* __restrict__ ext, const long long* __restrict__ input_lengths,
    const long long* __restrict__ target_lengths, double* __restrict__ rows, unsigned char* __restrict__ back,
    double* __restrict__ edges, int* __restrict__ sync, double* __restrict__ last, long long* __restrict__ states,
    int T_max, int N, int C, int S_max, int blank, int tile, int tiles, int frames, int every, int segment)
{
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int ticket;
    if (threadIdx.x == 0) ticket = atomicAdd(sync, 1);
    __syncthreads();
    const int n = ticket / tiles, b = ticket % tiles;
    const int T = (int)input_lengths[n], S = 2 * (int)target_lengths[n] + 1, lo = b * tile, hi = min(S, lo + tile);
    const int J = T > 1 ? (T - 2) / every + 1 : 1;                   // segments of this sequence
    if (T == 0 || lo >= S || (segment < 0 ? J == 1 : segment >= J)) return;   // the whole block: no barrier is split
    const int t0 = segment < 0 ? 0 : segment * every, t1 = segment < 0 ? (J - 1) * every : min(t0 + every, T - 1);
    const int W = tile + 2;                                          // slot x holds state lo - 2 + x
    double* buf = (double*)smem;                                     // frames t0 + i in buf + (i % 2) * W
    const long long* e = ext + (long long)n * S_max;
    volatile int* progress = sync + 1 + (long long)n * tiles;        // progress[b]: this segment's frames published
    volatile double* edge = edges + (long long)n * tiles * frames * 2;
    const bool linked = b > 0 || hi < S;                             // a block below or above: edges to read or write
    for (int x = threadIdx.x; x < hi - lo + 2; x += blockDim.x) {    // frame t0, with the two states below the block
        const int s = lo - 2 + x;
        buf[x] = s < 0 ? -INFINITY : t0 == 0 ? (s < 2 ? 0.0 : -INFINITY) + (double)lp[(long long)n * C + e[s]]
                                             : rows[((long long)(segment - 1) * N + n) * S_max + s];
    }
    for (int i = 1; i <= t1 - t0; i++) {
        const int t = t0 + i;
        double* prev = buf + ((i + 1) % 2) * W;
        double* cur = buf + (i % 2) * W;
        if (linked) __syncthreads();                                 // frame t - 1 complete in this block (else: one
        if (linked && threadIdx.x == 0) {                            // barrier a frame, as the kernel had before tiles)
            if (hi < S && i > 1) {                                   // publish frame t - 1's top two states
                edge[((long long)b * frames + i - 1) * 2] = prev[hi - lo];
                edge[((long long)b * frames + i - 1) * 2 + 1] = prev[hi - lo + 1];
                __threadfence();
                progress[b] = i - 1;
            }
            if (b > 0 && i > 1) {                                    // the two states below, from the block below
#ifdef __CUDA_ARCH__
                while (progress[b - 1] < i - 1) {}
#else
                assert(progress[b - 1] >= i - 1);
#endif
                __threadfence();
                prev[0] = edge[((long long)(b - 1) * frames + i - 1) * 2];
                prev[1] = edge[((long long)(b - 1) * frames + i - 1) * 2 + 1];
            }
        }
        __syncthreads();
        const FLOAT* lp_t = lp + ((long long)t * N + n) * C;
        for (int s = lo + threadIdx.x; s < hi; s += blockDim.x) {
            const int x = s - lo + 2;
            double v = prev[x];
            unsigned char w = 0;
            if (s >= 1 && prev[x - 1] > v) { v = prev[x - 1]; w = 1; }
            if (may_skip(e, s, blank) && prev[x - 2] > v) { v = prev[x - 2]; w = 2; }
            cur[x] = v + (double)lp_t[e[s]];
            if (segment >= 0) back[((long long)(i - 1) * N + n) * S_max + s] = w;
            else if (t % every == 0) rows[((long long)(t / every - 1) * N + n) * S_max + s] = cur[x];
        }
    }
    __syncthreads();
    const double* fin = buf + ((t1 - t0) % 2) * W;                   // frame t1
    if (segment < 0 || threadIdx.x != 0) return;
    if (t1 == T - 1) {                                               // the last frame's scores of the final states
        if (lo <= S - 2 && S - 2 < hi) last[2 * n] = fin[S - 2 - lo + 2];
        if (S == 1) last[2 * n] = -INFINITY;
        if (hi == S) last[2 * n + 1] = fin[S - 1 - lo + 2];
    }
    const int n_tiles = (S + tile - 1) / tile;
    __threadfence();
    if (atomicAdd(sync + 1 + (long long)N * tiles + n, 1) != n_tiles - 1) return;   // not the last block to finish
    __threadfence();
    const volatile double* z = last + 2 * n;
    if (z[0] == -INFINITY && z[1] == -INFINITY) return;              // no path
    long long* st = states + (long long)n * T_max;
    int s;
    if (t1 == T - 1) st[t1] = s = z[0] > z[1] ? S - 2 : S - 1;       // the last blank, or the last label if better
    else s = (int)((volatile long long*)st)[t1];                     // where the later segment's walk arrived
    const volatile unsigned char* bp = back;
    for (int t = t1; t > t0; t--) {
        s -= bp[((long long)(t - t0 - 1) * N + n) * S_max + s];
        st[t - 1] = s;
    }
}
