// The CTC prefix beam search on a GPU (written by nbs/11e_ctc_beam_cuda.ipynb): `_beam_search_kernel`'s search of
// token sequences (no words, language model, lexicon or hotwords), one block per utterance, no host read between
// frames. Frame by frame: the token ids are sorted by the frame's log-probability (a bitonic network over the block);
// each beam stays (a blank, or its last label again) and takes in the extensions of its parent that are itself (a
// thread per beam); each beam proposes its stay and its extensions by its M likeliest tokens (M = hcap + beam + 1, or
// C - 1: of those, at most beam - 1 are its children, merged, and one its last label, so hcap of the others outrank
// any token after them); the candidates are sorted by score (the same network); one thread takes the best hcap
// (beam, or 2 beam to recombine: max semiring, one best) within `threshold` of the best, drops those another with the
// same last token dominates (no better ending in a blank and in a label), keeps the best beam of the rest and gives
// the extensions new nodes. At the end one thread ranks the beams and walks the n best back. The CPU kernel's hypotheses and scores,
// the same arithmetic in the same order. Scratch per utterance in global memory (`work`, `work_bytes` each).
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)   // (NVRTC has no <cmath>; semiring.cuh's definition)
#endif

__device__ __forceinline__ double semiring_plus(double a, double b, int use_max) {
    if (use_max) return a > b ? a : b;
    if (a == -INFINITY) return b;
    if (b == -INFINITY) return a;
    const double hi = a > b ? a : b, lo = a > b ? b : a;
    return hi + log1p(exp(lo - hi));                    // (the CPU kernel's _lae: max + log1p(exp(-|a - b|)))
}

struct CtcBeamWork {          // one utterance's scratch
    int *parent, *tok;                                  // the prefix tree's nodes (cap)
    int *b_node, *child_of;                             // the beam, each one's parent beam (beam)
    double *b_pb, *b_pnb, *s_pb, *s_pnb;                // (beam)
    int *n_node, *n_beam; double *n_pb, *n_pnb;         // the survivors (hcap)
    int *top;                                           // the tokens by falling log-probability (PC)
    int *order;                                         // the candidates' order (P)
    double *c_score;                                    // (n_cand)
};

__device__ CtcBeamWork ctc_beam_layout(unsigned char* base, int cap, int beam, int hcap, int PC, int n_cand, int P) {
    CtcBeamWork w;
    size_t at = 0;
    #define TAKE(ptr, type, count) (at = (at + 7) & ~(size_t)7, ptr = (type*)(base + at), at += sizeof(type) * (size_t)(count))
    TAKE(w.b_pb, double, beam); TAKE(w.b_pnb, double, beam); TAKE(w.s_pb, double, beam); TAKE(w.s_pnb, double, beam);
    TAKE(w.n_pb, double, hcap); TAKE(w.n_pnb, double, hcap); TAKE(w.c_score, double, n_cand);
    TAKE(w.parent, int, cap); TAKE(w.tok, int, cap); TAKE(w.b_node, int, beam); TAKE(w.child_of, int, beam);
    TAKE(w.n_node, int, hcap); TAKE(w.n_beam, int, hcap); TAKE(w.top, int, PC); TAKE(w.order, int, P);
    #undef TAKE
    return w;
}

#include "block_sort.cuh"             // block_sort: a bitonic network over the block

struct ByLogProb {            // the tokens by falling log-probability, then by id; the blank last
    const double* row; int blank;
    __device__ bool operator()(int a, int b) const {
        if (a == blank || b == blank) return b == blank && a != blank;
        return row[a] > row[b] || (row[a] == row[b] && a < b);
    }
};
struct ByScore {              // the candidates by falling score, then by position
    const double* s;
    __device__ bool operator()(int a, int b) const { return s[a] > s[b] || (s[a] == s[b] && a < b); }
};

extern "C" __global__ void ctc_beam_search(
    const double* __restrict__ lp, const long long* __restrict__ il, int blank, int beam, double threshold,
    int use_max, int recombine, long long* __restrict__ out_tokens, long long* __restrict__ out_len,
    double* __restrict__ out_score, long long* __restrict__ out_n, unsigned char* __restrict__ work,
    long long work_bytes, int T, int C, int nbest, int M, int PC, int P)
{
    const int b = blockIdx.x, hcap = recombine ? 2 * beam : beam, cap = T * beam + 1, n_cand = beam + beam * M;
    CtcBeamWork w = ctc_beam_layout(work + (long long)b * work_bytes, cap, beam, hcap, PC, n_cand, P);
    __shared__ int nb_s, n_nodes_s;
    if (threadIdx.x == 0) {
        w.parent[0] = -1; w.tok[0] = -1; w.b_node[0] = 0; w.b_pb[0] = 0.0; w.b_pnb[0] = -INFINITY;
        nb_s = 1; n_nodes_s = 1;
    }
    __syncthreads();
    for (int t = 0; t < il[b]; t++) {
        const double* row = lp + ((long long)b * T + t) * C;
        const int nb = nb_s;
        block_sort(w.top, C, PC, ByLogProb{row, blank});
        for (int i = threadIdx.x; i < nb; i += blockDim.x) {          // the stays, and each beam's parent beam
            const int nd = w.b_node[i];
            w.s_pb[i] = semiring_plus(w.b_pb[i], w.b_pnb[i], use_max) + row[blank];
            w.s_pnb[i] = nd != 0 ? w.b_pnb[i] + row[w.tok[nd]] : -INFINITY;
            w.child_of[i] = -1;
            for (int p = 0; p < nb && nd != 0; p++) if (w.b_node[p] == w.parent[nd]) w.child_of[i] = p;
        }
        __syncthreads();
        for (int j = threadIdx.x; j < nb; j += blockDim.x) {          // a beam is also its parent beam's extension
            const int i = w.child_of[j];
            if (i < 0) continue;
            const int k = w.tok[w.b_node[j]];
            const double base = w.tok[w.b_node[i]] == k ? w.b_pb[i] : semiring_plus(w.b_pb[i], w.b_pnb[i], use_max);
            w.s_pnb[j] = semiring_plus(w.s_pnb[j], base + row[k], use_max);
        }
        __syncthreads();
        const int n_c = nb + nb * M;
        for (int c = threadIdx.x; c < n_c; c += blockDim.x) {         // the candidates: stays, then extensions
            double s;
            if (c < nb) s = semiring_plus(w.s_pb[c], w.s_pnb[c], use_max);
            else {
                const int i = (c - nb) / M, k = w.top[(c - nb) % M], nd = w.b_node[i];
                bool merged = false;
                for (int j = 0; j < nb; j++) merged |= w.child_of[j] == i && w.tok[w.b_node[j]] == k;
                s = merged ? -INFINITY : (k == w.tok[nd] ? w.b_pb[i] : semiring_plus(w.b_pb[i], w.b_pnb[i], use_max)) + row[k];
            }
            w.c_score[c] = s;
        }
        __syncthreads();
        block_sort(w.order, n_c, P, ByScore{w.c_score});
        if (threadIdx.x == 0) {                                        // the survivors
            const double best = w.c_score[w.order[0]];
            int m = 0, n_nodes = n_nodes_s;
            for (int r = 0; r < n_c && r < hcap; r++) {
                const int c = w.order[r];
                const double s = w.c_score[c];
                if (s == -INFINITY || s < best - threshold) break;
                const int i = c < nb ? c : (c - nb) / M, last = c < nb ? w.tok[w.b_node[i]] : w.top[(c - nb) % M];
                const double pb = c < nb ? w.s_pb[i] : -INFINITY, pnb = c < nb ? w.s_pnb[i] : s;
                // recombining: out if a kept one dominates it, and the kept ones it dominates go (the kept stay in
                // falling order of score: the non-dominated of the best hcap, as the CPU kernel's pairs leave them)
                bool out = false;
                int m2 = 0;
                for (int q = 0; q < m; q++) {
                    const int kept_last = w.n_node[q] >= 0 ? w.tok[w.n_node[q]] : w.top[-w.n_node[q] - 1];
                    const bool rival = recombine && kept_last == last && !(pb == w.n_pb[q] && pnb == w.n_pnb[q]);
                    out |= rival && pb <= w.n_pb[q] && pnb <= w.n_pnb[q];
                    if (rival && w.n_pb[q] <= pb && w.n_pnb[q] <= pnb) continue;
                    w.n_node[m2] = w.n_node[q]; w.n_beam[m2] = w.n_beam[q]; w.n_pb[m2] = w.n_pb[q]; w.n_pnb[m2] = w.n_pnb[q];
                    m2++;
                }
                m = m2;
                if (out) continue;
                w.n_node[m] = c < nb ? w.b_node[i] : -((c - nb) % M) - 1;   // (an extension: its token's rank, for now)
                w.n_beam[m] = i; w.n_pb[m] = pb; w.n_pnb[m] = pnb;
                m++;
            }
            if (m > beam) m = beam;
            for (int q = 0; q < m; q++) {                              // the extensions' nodes
                if (w.n_node[q] < 0) {
                    const int nd = n_nodes++;
                    w.parent[nd] = w.b_node[w.n_beam[q]]; w.tok[nd] = w.top[-w.n_node[q] - 1];
                    w.n_node[q] = nd;
                }
            }
            for (int q = 0; q < m; q++) { w.b_node[q] = w.n_node[q]; w.b_pb[q] = w.n_pb[q]; w.b_pnb[q] = w.n_pnb[q]; }
            nb_s = m; n_nodes_s = n_nodes;
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    const int nb = nb_s;                                               // the n best, walked back
    for (int i = 0; i < nb; i++) w.s_pb[i] = semiring_plus(w.b_pb[i], w.b_pnb[i], use_max);
    long long n_out = 0;
    for (int r = 0; r < nbest && r < nb; r++) {
        int k = -1;
        for (int i = 0; i < nb; i++) if (w.s_pb[i] > -INFINITY && (k < 0 || w.s_pb[i] > w.s_pb[k])) k = i;
        if (k < 0) break;
        const long long o = (long long)b * nbest + r;
        out_score[o] = w.s_pb[k]; w.s_pb[k] = -INFINITY;
        int L = 0;
        for (int nd = w.b_node[k]; nd != 0; nd = w.parent[nd]) L++;
        out_len[o] = L;
        int j = L - 1;
        for (int nd = w.b_node[k]; nd != 0; nd = w.parent[nd]) out_tokens[o * T + j--] = w.tok[nd];
        n_out++;
    }
    out_n[b] = n_out;
}
