// koi.decode's beam search on a GPU (written by nbs/05_crf.ipynb): `_beam_search_cpu`, step for step, one block per
// read. Frame by frame: the hypotheses propose their stay and four moves (a thread per hypothesis, each candidate at
// the CPU kernel's position); the candidates are sorted by (hash, position) (a bitonic network over the block: the
// order numpy's stable mergesort gives, as every key is distinct); one thread merges the runs of equal (hash, state)
// in that order, with the CPU kernel's arithmetic; the merged are ranked by (-guided score, position) (the same
// network: the stable argsort of -guided), and one thread keeps at most beam_width of them, none more than log_cut
// below the best. Then one thread traces the best final hypothesis back. So the same inputs give the CPU kernel's
// hypotheses, scores and path, bit for bit where the math library is the same (the emulator's). Scratch, per read, in
// global memory (`work`, `work_bytes` a read, laid out by `beam_layout`); no host sync between frames.
#ifndef HASH_MUL
#define HASH_MUL 0x100000001B3ULL
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)   // (NVRTC has no <cmath>; semiring.cuh's definition)
#endif

struct BeamWork {             // one read's scratch: the frames' back-pointers, the candidates, the merged, the beam
    int* parent; signed char* bases; int* states;                      // (T, beam_width)
    int* c_state; double* c_score; long long* c_hash; int* c_parent; signed char* c_base; double* c_best;   // (n_cand,)
    int* m_index; double* m_guided; int* order;                        // (n_cand,), order: (P,) a power of 2 >= n_cand
    double* h_score; long long* h_hash; double* n_score; long long* n_hash;   // (beam_width,)
};

__device__ BeamWork beam_layout(unsigned char* base, int T, int beam_width, int n_cand, int P) {
    BeamWork w;
    size_t at = 0;
    #define TAKE(ptr, type, count) (at = (at + 7) & ~(size_t)7, ptr = (type*)(base + at), at += sizeof(type) * (size_t)(count))
    TAKE(w.c_score, double, n_cand); TAKE(w.c_best, double, n_cand); TAKE(w.m_guided, double, n_cand);
    TAKE(w.c_hash, long long, n_cand); TAKE(w.h_score, double, beam_width); TAKE(w.h_hash, long long, beam_width);
    TAKE(w.n_score, double, beam_width); TAKE(w.n_hash, long long, beam_width);
    TAKE(w.c_state, int, n_cand); TAKE(w.c_parent, int, n_cand); TAKE(w.m_index, int, n_cand); TAKE(w.order, int, P);
    TAKE(w.parent, int, (size_t)T * beam_width); TAKE(w.states, int, (size_t)T * beam_width);
    TAKE(w.c_base, signed char, n_cand); TAKE(w.bases, signed char, (size_t)T * beam_width);
    #undef TAKE
    return w;
}

#include "block_sort.cuh"

struct ByHash {               // numpy's stable argsort of the (signed) hashes: by hash, then by position
    const long long* h;
    __device__ bool operator()(int a, int b) const { return h[a] < h[b] || (h[a] == h[b] && a < b); }
};
struct ByGuided {             // the stable argsort of -guided: the larger guided score first, then the lower position
    const double* g;
    __device__ bool operator()(int a, int b) const { return -g[a] < -g[b] || (-g[a] == -g[b] && a < b); }
};

extern "C" __global__ void beam_search(
    const double* __restrict__ M, double blank, const double* __restrict__ alpha1, const double* __restrict__ beta,
    int beam_width, double log_cut, double* __restrict__ best_score, signed char* __restrict__ path_base,
    int* __restrict__ path_state, unsigned char* __restrict__ work, long long work_bytes, int N, int T, int C,
    int n_cand, int P)
{
    const int n = blockIdx.x, shift = C / 4;
    BeamWork w = beam_layout(work + (long long)n * work_bytes, T, beam_width, n_cand, P);
    __shared__ int K_s, n_c_s, n_m_s;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {               // frame 0: every state is a hypothesis
        w.c_state[c] = c; w.c_score[c] = alpha1[(long long)n * C + c]; w.c_hash[c] = c + 1; w.c_parent[c] = -1;
        w.c_base[c] = (signed char)(c % 4);
    }
    if (threadIdx.x == 0) { n_c_s = C; K_s = 0; }
    __syncthreads();
    for (int t = 0; t < T; t++) {
        const int K = K_s;
        if (t > 0) {                                                   // propose: each hypothesis' stay and four moves
            for (int i = threadIdx.x; i < K; i += blockDim.x) {
                const int s = w.states[(size_t)(t - 1) * beam_width + i], o = 5 * i;
                w.c_state[o] = s; w.c_score[o] = w.h_score[i] + blank; w.c_hash[o] = w.h_hash[i];
                w.c_parent[o] = i; w.c_base[o] = -1;
                for (int b = 0; b < 4; b++) {
                    const int c = (s * 4 + b) % C;
                    w.c_state[o + 1 + b] = c;
                    w.c_score[o + 1 + b] = w.h_score[i] + M[(((long long)n * T + t) * C + c) * 4 + s / shift];
                    w.c_hash[o + 1 + b] = (long long)((unsigned long long)w.h_hash[i] * HASH_MUL + (unsigned long long)(b + 1));
                    w.c_parent[o + 1 + b] = i; w.c_base[o + 1 + b] = (signed char)b;
                }
            }
            if (threadIdx.x == 0) n_c_s = 5 * K;
            __syncthreads();
        }
        const int n_c = n_c_s;
        block_sort(w.order, n_c, P, ByHash{w.c_hash});
        if (threadIdx.x == 0) {                                        // merge: the same (hash, state) is one hypothesis
            int n_m = 0, i = 0;
            const double* beta_t = beta + ((long long)(t + 1) * N + n) * C;
            while (i < n_c) {
                const int k = w.order[i];
                double total = w.c_score[k], top = w.c_score[k];
                int rep = k;
                i++;
                while (i < n_c && w.c_hash[w.order[i]] == w.c_hash[k] && w.c_state[w.order[i]] == w.c_state[k]) {
                    const double x = w.c_score[w.order[i]];
                    const double hi = total > x ? total : x, lo = total < x ? total : x;
                    total = lo > -INFINITY ? hi + log1p(exp(lo - hi)) : hi;
                    if (x > top) { top = x; rep = w.order[i]; }      // the best alignment's parent and base represent it
                    i++;
                }
                w.c_best[rep] = total;
                w.m_index[n_m] = rep;
                w.m_guided[n_m] = total + beta_t[w.c_state[rep]];
                n_m++;
            }
            n_m_s = n_m;
        }
        __syncthreads();
        const int n_m = n_m_s;
        block_sort(w.order, n_m, P, ByGuided{w.m_guided});
        if (threadIdx.x == 0) {                                        // prune: the best beam_width, within log_cut
            double best = -INFINITY;
            for (int m = 0; m < n_m; m++) if (w.m_guided[m] > best) best = w.m_guided[m];
            int K2 = 0;
            for (int r = 0; r < n_m && r < beam_width; r++) {
                const int m = w.order[r];
                if (r > 0 && w.m_guided[m] < best - log_cut) break;   // the best stays (beam_cut < 1 cuts under it)
                const int k = w.m_index[m];
                w.parent[(size_t)t * beam_width + K2] = w.c_parent[k];
                w.bases[(size_t)t * beam_width + K2] = w.c_base[k];
                w.states[(size_t)t * beam_width + K2] = w.c_state[k];
                w.n_score[K2] = w.c_best[k]; w.n_hash[K2] = w.c_hash[k];
                K2++;
            }
            for (int r = 0; r < K2; r++) { w.h_score[r] = w.n_score[r]; w.h_hash[r] = w.n_hash[r]; }
            K_s = K2;
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    const int K = K_s;                                                 // trace the best final hypothesis back
    int k = 0;
    for (int i = 1; i < K; i++) if (w.h_score[i] > w.h_score[k]) k = i;
    best_score[n] = w.h_score[k];
    for (int t = T - 1; t >= 0; t--) {
        path_base[(long long)n * T + t] = w.bases[(size_t)t * beam_width + k];
        path_state[(long long)n * T + t] = w.states[(size_t)t * beam_width + k];
        k = w.parent[(size_t)t * beam_width + k];
    }
}
