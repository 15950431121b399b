// The CTC prefix beam search on a GPU (written by nbs/11e_ctc_beam_cuda.ipynb): `_beam_search_kernel`'s search of
// token sequences with the words they spell (`token_kinds`: a delimiter or a word start ends the word being spelled,
// which is scored when the next token comes and at the end, as the CPU kernel does: `word_score` a word and the LM's
// log10 probability times `lm_weight`, the word found by walking the LM's spelling trie; or each token a word, a
// token-level LM; a lexicon whose words alone may be spelled, whole words, the LM lookahead and the partial-word
// score, and merged delimiters, as the CPU kernel has them) and hotwords (`Hotwords`' automaton), one block per
// utterance, no host read between frames. Frame by frame: the token ids are
// sorted by the frame's log-probability (a bitonic network over the block); each beam stays (a blank, or its last
// label again) and takes in the extensions of its parent that are itself (a thread per beam); each beam proposes its
// stay and its extensions by its M likeliest tokens (M = hcap + beam + 1, or C - 1: of those, at most beam - 1 are
// its children, merged, and one its last label, so hcap of the others outrank any token after them: an extension's
// word scores do not depend on its token; with hotwords, whose credit does, or words spelled by tokens, whose word is
// done by some tokens and not others, each beam has its own M best tokens by log-probability plus what the token
// earns, a thread per beam); the candidates are sorted by score (the same network); one thread takes
// the best hcap (beam, or 2 beam to recombine: max semiring, one best) within `threshold` of the best, drops those
// another with the same last token and LM state dominates (no better ending in a blank and in a label), keeps the
// best beam of the rest and gives the extensions new nodes (their LM step). At the end one thread ranks the beams
// and walks the n best back. The CPU kernel's hypotheses and scores, the same arithmetic in the same order. Scratch
// per utterance in global memory (`work`, `work_bytes` each).
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)   // (NVRTC has no <cmath>; semiring.cuh's definition)
#endif
#include "block_sort.cuh"             // block_sort: a bitonic network over the block

__device__ __forceinline__ double semiring_plus(double a, double b, int use_max) {
    if (use_max) return a > b ? a : b;
    if (a == -INFINITY) return b;
    if (b == -INFINITY) return a;
    const double hi = a > b ? a : b, lo = a > b ? b : a;
    return hi + log1p(exp(lo - hi));                    // (the CPU kernel's _lae: max + log1p(exp(-|a - b|)))
}

struct NGramTables {          // `NGramLM.tables`: an open-addressed table of (context id * V + word) -> n-gram id
    const long long *keys, *values; int shift; long long V;
    const double *log10p, *backoff; const long long *suffix, *order; long long max_order;
};

__device__ long long table_find(const long long* keys, const long long* values, int shift, long long key) {
    const long long mask = (1LL << (64 - shift)) - 1;                         // `_find`: Fibonacci hash, linear probing
    long long h = (long long)(((unsigned long long)key * 11400714819323198485ULL) >> shift);   // (2^(64 - shift) slots)
    while (keys[h] != key && keys[h] != -1) h = (h + 1) & mask;
    return keys[h] == key ? values[h] : -1;
}
__device__ long long ngram_find(const NGramTables& lm, long long key) { return table_find(lm.keys, lm.values, lm.shift, key); }

struct HotTables {            // `Hotwords`' automaton (`_hot_tables`): children (s * C + k -> state), failure links, the
    const long long *keys, *values; int shift; const long long *fail, *moves; long long n_moves;   // dense moves
    const double *partial, *done;                      // (`Hotwords.moves`: every state's row, or the root's), credits
};
__device__ long long trie_walk(const long long* keys, const long long* values, int shift, long long K, long long node,
                               const long long* codes, long long lo, long long hi) {   // `_walk`: the characters codes[lo:hi]
    for (long long c = lo; c < hi && node >= 0; c++) node = table_find(keys, values, shift, node * K + codes[c]);
    return node;
}
struct WordTables {           // the words tokens spell: kinds, characters (`code_off`), the spelling trie
    const signed char* kind; const long long *code_off, *codes;          // (`_spelling_trie`: its LM words and
    const long long *keys, *values; int shift; long long K;             // lexicon flags) and lookahead (`_trie_smear`)
    const long long* word; const signed char* lexicon; const double* smear;
    double smear_w, unk_prefix; int use_lexicon, use_smear, use_unk_prefix, walk;
};
// token k after a node whose word being spelled is at trie `node` (`has_word`, `plen` characters): false where the
// lexicon forbids it (`_spellable`), else the trie node its word reaches (-2: not walked) and what the ranking adds
// for it, the partial-word score and the lookahead (0 where none: the CPU kernel's candidates, term for term)
__device__ bool spell_token(const WordTables& wt, long long node, int has_word, int plen, int k, long long* tn,
                            double* unk_term, double* smear_term) {
    const int kind = wt.kind[k];
    const long long lo = wt.code_off[k], hi = wt.code_off[k + 1];
    *tn = -2; *unk_term = 0.0; *smear_term = 0.0;
    if (wt.use_lexicon) {
        long long n = node;
        if (kind != 0) {                                 // (a delimiter or a word start completes a lexicon word)
            if (has_word && (n < 0 || wt.lexicon[n] < 2)) return false;
            n = 0;
        }
        if (kind != 1 && hi > lo) {                      // (its characters begin a lexicon word)
            n = trie_walk(wt.keys, wt.values, wt.shift, wt.K, n, wt.codes, lo, hi);
            if (n < 0 || wt.lexicon[n] < 1) return false;
        }
        *tn = n;
    }
    if ((wt.use_unk_prefix || wt.use_smear) && kind != 1 && hi > lo) {
        const bool cont = kind == 0 && has_word;
        if (*tn == -2) *tn = trie_walk(wt.keys, wt.values, wt.shift, wt.K, cont ? node : 0, wt.codes, lo, hi);
        if (wt.use_unk_prefix && *tn < 0) *unk_term = wt.unk_prefix * fmax(1.0, ((cont ? plen : 0) + (hi - lo)) / 6.0);
        if (wt.use_smear && *tn >= 0) *smear_term = fmin(0.0, wt.smear_w * wt.smear[*tn]);
    }
    return true;
}
__device__ long long hot_next(const HotTables& hw, int C, long long s, int k) {    // `_hot_next`
    if ((s + 1) * C <= hw.n_moves) return hw.moves[s * C + k];
    for (; s != 0; s = hw.fail[s]) {
        const long long c = table_find(hw.keys, hw.values, hw.shift, s * C + k);
        if (c >= 0) return c;
    }
    return hw.moves[k];
}

// `lm_step`: log10 P(word | state) by back-off, and the state after the word
__device__ double ngram_step(const NGramTables& lm, long long state, long long word, long long* next) {
    double bo = 0.0;
    long long ctx = state;
    while (true) {
        const long long i = ngram_find(lm, ctx * lm.V + word);
        if (i >= 0) { *next = lm.order[i] == lm.max_order ? lm.suffix[i] : i; return bo + lm.log10p[i]; }
        if (ctx == 0) { *next = 0; return -INFINITY; }
        bo += lm.backoff[ctx];
        ctx = lm.suffix[ctx];
    }
}

struct CtcBeamWork {          // one utterance's scratch
    int *parent, *tok; signed char* has_word;           // the prefix tree's nodes (cap): a token word pending?
    long long *lm_state, *done_state; double *wscore, *done_score;   // its words' LM state and score, the pending one's
    int *b_node, *child_of;                             // the beam, each one's parent beam (beam)
    double *b_pb, *b_pnb, *s_pb, *s_pnb;                // (beam)
    int *n_node, *n_beam; double *n_pb, *n_pnb, *n_ws; long long* n_state;   // the survivors (hcap)
    int *top;                                           // the tokens by falling log-probability (PC)
    int *order;                                         // the candidates' order (P)
    double *c_score;                                    // (n_cand)
    long long *hot, *n_hot; int* b_top; double* b_key;  // hotwords: each node's state, the survivors', each beam's tokens
    long long *trie, *n_trie; int *plen, *n_plen; signed char* n_hw;   // words: the one being spelled (trie node, length)
    double* run;                                        // each node's rank beyond its acoustic score (the CPU kernel's)
};

__device__ CtcBeamWork ctc_beam_layout(unsigned char* base, int cap, int beam, int hcap, int PC, int n_cand, int P, int M, int use_hot,
                                   int own_tokens, int use_words) {
    CtcBeamWork w;
    size_t at = 0;
    #define TAKE(ptr, type, count) (at = (at + 7) & ~(size_t)7, ptr = (type*)(base + at), at += sizeof(type) * (size_t)(count))
    TAKE(w.b_pb, double, beam); TAKE(w.b_pnb, double, beam); TAKE(w.s_pb, double, beam); TAKE(w.s_pnb, double, beam);
    TAKE(w.n_pb, double, hcap); TAKE(w.n_pnb, double, hcap); TAKE(w.n_ws, double, hcap); TAKE(w.n_state, long long, hcap);
    TAKE(w.c_score, double, n_cand);
    TAKE(w.wscore, double, cap); TAKE(w.done_score, double, cap); TAKE(w.lm_state, long long, cap);
    TAKE(w.done_state, long long, cap); TAKE(w.parent, int, cap); TAKE(w.tok, int, cap); TAKE(w.b_node, int, beam);
    TAKE(w.child_of, int, beam); TAKE(w.n_node, int, hcap); TAKE(w.n_beam, int, hcap); TAKE(w.top, int, PC);
    TAKE(w.order, int, P); TAKE(w.has_word, signed char, cap);
    const int H = use_hot ? 1 : 0, O = own_tokens ? 1 : 0, W = use_words ? 1 : 0;   // (what a search does not use: none)
    TAKE(w.hot, long long, H * cap); TAKE(w.n_hot, long long, H * hcap); TAKE(w.b_top, int, O * beam * M); TAKE(w.b_key, double, O * beam * M);
    TAKE(w.trie, long long, W * cap); TAKE(w.n_trie, long long, W * hcap); TAKE(w.plen, int, W * cap);
    TAKE(w.n_plen, int, W * hcap); TAKE(w.n_hw, signed char, W * hcap); TAKE(w.run, double, cap);
    #undef TAKE
    return w;
}

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
    int use_max, int recombine, int use_words, int use_lm, const signed char* __restrict__ kind,
    const long long* __restrict__ code_off, const long long* __restrict__ codes, const long long* __restrict__ trie_keys,
    const long long* __restrict__ trie_values, int trie_shift, long long K, const long long* __restrict__ trie_word,
    const signed char* __restrict__ trie_lexicon, const double* __restrict__ trie_smear, double smear_w, double unk_prefix,
    int use_lexicon, int whole, int merge, int own_tokens,
    double word_score, double unk_score, double lm_weight, long long unk, long long eos, long long begin_state,
    const long long* __restrict__ lm_keys, const long long* __restrict__ lm_values, int lm_shift, long long V,
    const double* __restrict__ log10p, const double* __restrict__ backoff, const long long* __restrict__ suffix,
    const long long* __restrict__ ngram_order, long long max_order, int use_hot, const long long* __restrict__ hot_keys,
    const long long* __restrict__ hot_values, int hot_shift, const long long* __restrict__ hot_fail,
    const long long* __restrict__ hot_moves, long long n_moves, const double* __restrict__ hot_partial,
    const double* __restrict__ hot_done,
    long long* __restrict__ out_tokens, long long* __restrict__ out_len, double* __restrict__ out_score,
    long long* __restrict__ out_n, unsigned char* __restrict__ work, long long work_bytes, int T, int C, int nbest,
    int M, int PC, int P)
{
    const int b = blockIdx.x, hcap = recombine ? 2 * beam : beam, cap = T * beam + 1, n_cand = beam + beam * M;
    const NGramTables lm{lm_keys, lm_values, lm_shift, V, log10p, backoff, suffix, ngram_order, max_order};
    const HotTables hw{hot_keys, hot_values, hot_shift, hot_fail, hot_moves, n_moves, hot_partial, hot_done};
    const WordTables wt{kind, code_off, codes, trie_keys, trie_values, trie_shift, K, trie_word, trie_lexicon, trie_smear,
                        smear_w, unk_prefix, use_lexicon, smear_w != 0.0, use_lm && unk_prefix != 0.0, use_lm || use_lexicon};
    CtcBeamWork w = ctc_beam_layout(work + (long long)b * work_bytes, cap, beam, hcap, PC, n_cand, P, M, use_hot, own_tokens, use_words);
    // extension r of beam i: its token (each beam's own list where a token's worth depends on the beam); merging, a
    // delimiter at a gap (the start, or after a delimiter) is a stay, not an extension
    #define TOKEN_AT(i, r) (own_tokens ? w.b_top[(long long)(i) * M + (r)] : w.top[r])
    #define AT_GAP(nd) (merge && ((nd) == 0 || kind[w.tok[nd]] == 1))
    __shared__ int nb_s, n_nodes_s;
    if (threadIdx.x == 0) {
        w.parent[0] = -1; w.tok[0] = -1; w.has_word[0] = 0; w.lm_state[0] = begin_state; w.done_state[0] = begin_state;
        w.wscore[0] = 0.0; w.done_score[0] = 0.0; w.run[0] = 0.0;
        if (use_hot) w.hot[0] = 0;
        if (use_words) { w.trie[0] = 0; w.plen[0] = 0; }
        w.b_node[0] = 0; w.b_pb[0] = 0.0; w.b_pnb[0] = -INFINITY;
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
            if (AT_GAP(nd)) {                                          // (merging: by any delimiter)
                double gap = -INFINITY;
                for (int k = 0; k < C; k++) if (k != blank && kind[k] == 1) gap = semiring_plus(gap, row[k], use_max);
                w.s_pnb[i] = semiring_plus(w.b_pb[i], w.b_pnb[i], use_max) + gap;
            }
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
        for (int i = threadIdx.x; i < nb && own_tokens; i += blockDim.x) {   // each beam's M best tokens, earnings counted
            int* top = w.b_top + (long long)i * M; double* key = w.b_key + (long long)i * M;
            const int nd = w.b_node[i];
            int n = 0;
            for (int k = 0; k < C; k++) {                                  // (insertion: ties, the smaller token first)
                if (k == blank) continue;
                long long tn; double ut, st;
                double v = row[k] + (use_words && kind[k] != 0 ? w.done_score[nd] : 0.0);
                if (use_hot) { const long long h = hot_next(hw, C, w.hot[nd], k); v += hw.done[h] + hw.partial[h]; }
                if (use_words) v = spell_token(wt, w.trie[nd], w.has_word[nd], w.plen[nd], k, &tn, &ut, &st) ? v + ut + st : -INFINITY;
                if (AT_GAP(nd) && kind[k] == 1) v = -INFINITY;
                if (n == M && !(v > key[M - 1])) continue;
                int j = n < M ? n : M - 1;
                for (; j > 0 && key[j - 1] < v; j--) { top[j] = top[j - 1]; key[j] = key[j - 1]; }
                top[j] = k; key[j] = v;
                if (n < M) n++;
            }
        }
        __syncthreads();
        const int n_c = nb + nb * M;
        for (int c = threadIdx.x; c < n_c; c += blockDim.x) {         // the candidates: stays, then extensions
            double s;
            if (c < nb) {
                s = semiring_plus(w.s_pb[c], w.s_pnb[c], use_max);
                if (s > -INFINITY) s += w.run[w.b_node[c]];  // (ranked with its partial hotword credit and so on)
            } else {
                const int i = (c - nb) / M, k = TOKEN_AT(i, (c - nb) % M), nd = w.b_node[i];
                bool merged = false;
                for (int j = 0; j < nb; j++) merged |= w.child_of[j] == i && w.tok[w.b_node[j]] == k;
                long long tn; double ut = 0.0, st = 0.0;     // (refused by the lexicon: none)
                merged |= use_words && !spell_token(wt, w.trie[nd], w.has_word[nd], w.plen[nd], k, &tn, &ut, &st);
                merged |= AT_GAP(nd) && kind[k] == 1;
                s = merged ? -INFINITY : (k == w.tok[nd] ? w.b_pb[i] : semiring_plus(w.b_pb[i], w.b_pnb[i], use_max)) + row[k];
                if (s > -INFINITY) s += w.wscore[nd] + (use_words && kind[k] != 0 ? w.done_score[nd] : 0.0);   // (its word done)
                if (s > -INFINITY && use_hot) { const long long h = hot_next(hw, C, w.hot[nd], k); s += hw.done[h] + hw.partial[h]; }
                if (s > -INFINITY) { s += ut; s += st; }
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
                const int i = c < nb ? c : (c - nb) / M, p = w.b_node[i], last = c < nb ? w.tok[p] : TOKEN_AT(i, (c - nb) % M);
                const bool done = c >= nb && use_words && kind[last] != 0 && w.has_word[p];   // (an extension: its word done)
                const long long hot = !use_hot ? 0 : c < nb ? w.hot[p] : hot_next(hw, C, w.hot[p], last);
                double ws = done ? w.wscore[p] + w.done_score[p] : w.wscore[p];
                if (use_hot && c >= nb) ws += hw.done[hot];
                const long long state = done ? w.done_state[p] : w.lm_state[p];
                const int k = c < nb ? -1 : last;
                long long tn = use_words ? w.trie[p] : 0;                  // the word it spells (an extension: on)
                int hwd = use_words ? w.has_word[p] : 0, pl = use_words ? w.plen[p] : 0;
                if (c >= nb && use_words) {
                    if (kind[k] != 0) { tn = 0; hwd = 0; pl = 0; }
                    if (kind[k] != 1 && code_off[k + 1] > code_off[k]) {
                        tn = wt.walk ? trie_walk(trie_keys, trie_values, trie_shift, K, tn, codes, code_off[k], code_off[k + 1]) : -1;
                        hwd = 1; pl += (int)(code_off[k + 1] - code_off[k]);
                    }
                }
                const double pb = c < nb ? w.s_pb[i] : -INFINITY,
                             pnb = c < nb ? w.s_pnb[i] : (k == w.tok[p] ? w.b_pb[i] : semiring_plus(w.b_pb[i], w.b_pnb[i], use_max)) + row[k];
                // recombining: out if a kept one dominates it, and the kept ones it dominates go (the kept stay in
                // falling order of score: the non-dominated of the best hcap, as the CPU kernel's pairs leave them)
                bool out = false;
                int m2 = 0;
                const double ab = pb + ws, anb = pnb + ws;                 // (compared with their words' scores)
                for (int q = 0; q < m; q++) {
                    const int kept_last = w.n_node[q] >= 0 ? w.tok[w.n_node[q]] : TOKEN_AT(w.n_beam[q], -w.n_node[q] - 1);
                    const double qb = w.n_pb[q] + w.n_ws[q], qnb = w.n_pnb[q] + w.n_ws[q];
                    const bool rival = recombine && kept_last == last && w.n_state[q] == state &&
                                       (!use_hot || w.n_hot[q] == hot) && (!use_words || (w.n_trie[q] == tn &&
                                       w.n_hw[q] == hwd && w.n_plen[q] == pl)) && !(ab == qb && anb == qnb);
                    out |= rival && ab <= qb && anb <= qnb;
                    if (rival && qb <= ab && qnb <= anb) continue;
                    w.n_node[m2] = w.n_node[q]; w.n_beam[m2] = w.n_beam[q]; w.n_pb[m2] = w.n_pb[q]; w.n_pnb[m2] = w.n_pnb[q];
                    w.n_ws[m2] = w.n_ws[q]; w.n_state[m2] = w.n_state[q];
                    if (use_hot) w.n_hot[m2] = w.n_hot[q];
                    if (use_words) { w.n_trie[m2] = w.n_trie[q]; w.n_hw[m2] = w.n_hw[q]; w.n_plen[m2] = w.n_plen[q]; }
                    m2++;
                }
                m = m2;
                if (out) continue;
                w.n_node[m] = c < nb ? p : -((c - nb) % M) - 1;        // (an extension: its token's rank, for now)
                w.n_beam[m] = i; w.n_pb[m] = pb; w.n_pnb[m] = pnb; w.n_ws[m] = ws; w.n_state[m] = state;
                if (use_hot) w.n_hot[m] = hot;
                if (use_words) { w.n_trie[m] = tn; w.n_hw[m] = hwd; w.n_plen[m] = pl; }
                m++;
            }
            if (m > beam) m = beam;
            for (int q = 0; q < m; q++) {                              // the extensions' nodes: their words' state
                if (w.n_node[q] >= 0) continue;
                const int nd = n_nodes++, p = w.b_node[w.n_beam[q]], k = TOKEN_AT(w.n_beam[q], -w.n_node[q] - 1);
                const bool done = use_words && kind[k] != 0 && w.has_word[p];
                w.parent[nd] = p; w.tok[nd] = k; w.n_node[q] = nd;
                w.lm_state[nd] = done ? w.done_state[p] : w.lm_state[p];
                w.wscore[nd] = done ? w.wscore[p] + w.done_score[p] : w.wscore[p];
                if (use_hot) { w.hot[nd] = w.n_hot[q]; w.wscore[nd] += hw.done[w.n_hot[q]]; }   // (a phrase it completes)
                w.has_word[nd] = use_words && w.n_hw[q];
                if (use_words) { w.trie[nd] = w.n_trie[q]; w.plen[nd] = w.n_plen[q]; }
                const long long tn = use_words ? w.trie[nd] : 0;
                w.run[nd] = w.wscore[nd] + (use_hot ? hw.partial[w.hot[nd]] : 0.0);      // (the CPU kernel's terms)
                if (wt.use_unk_prefix && w.has_word[nd] && tn < 0) w.run[nd] += unk_prefix * fmax(1.0, w.plen[nd] / 6.0);
                if (wt.use_smear && w.has_word[nd] && tn >= 0) w.run[nd] += fmin(0.0, smear_w * trie_smear[tn]);
                w.done_score[nd] = 0.0; w.done_state[nd] = w.lm_state[nd];
                if (w.has_word[nd]) {
                    w.done_score[nd] = word_score;
                    if (use_lm && !(use_lexicon && (tn < 0 || trie_lexicon[tn] < 2))) {   // (the word spelled, else <unk>)
                        long long next, word = w.trie[nd] >= 0 ? trie_word[w.trie[nd]] : -1;
                        if (word < 0) word = unk;
                        if (word == unk) w.done_score[nd] += unk_score;              // (the CPU kernel's order)
                        w.done_score[nd] += lm_weight * ngram_step(lm, w.lm_state[nd], word, &next);
                        w.done_state[nd] = next;
                    }
                }
            }
            for (int q = 0; q < m; q++) { w.b_node[q] = w.n_node[q]; w.b_pb[q] = w.n_pb[q]; w.b_pnb[q] = w.n_pnb[q]; }
            nb_s = m; n_nodes_s = n_nodes;
        }
        __syncthreads();
    }
    #undef TOKEN_AT
    #undef AT_GAP
    if (threadIdx.x != 0) return;
    const int nb = nb_s;                                               // the end: the pending word and </s>
    int n_whole = 0;                                                   // (a hypothesis whose last word is none,
    for (int i = 0; i < nb; i++) {                                     // or not done with `whole`, is out unless
        const int nd = w.b_node[i];                                    // all are: then each without that word;
                                                                       // child_of, free now, flags the cut ones)
        double s = semiring_plus(w.b_pb[i], w.b_pnb[i], use_max) + w.wscore[nd];
        long long state = w.lm_state[nd], next;
        w.child_of[i] = w.has_word[nd] && (whole || use_lexicon && (w.trie[nd] < 0 || trie_lexicon[w.trie[nd]] < 2));
        if (w.has_word[nd] && !w.child_of[i]) { s += w.done_score[nd]; state = w.done_state[nd]; }
        if (use_lm) s += lm_weight * ngram_step(lm, state, eos, &next);
        w.s_pb[i] = s;
        n_whole += !w.child_of[i] && s > -INFINITY;
    }
    for (int i = 0; i < nb && n_whole; i++) if (w.child_of[i]) w.s_pb[i] = -INFINITY;
    for (int i = 0; i < nb && merge; i++) {                            // merging: one ending in a delimiter is its
        const int nd = w.b_node[i];                                    // parent's, if that is a beam
        if (nd == 0 || kind[w.tok[nd]] != 1) continue;
        for (int j = 0; j < nb; j++)
            if (w.b_node[j] == w.parent[nd]) { w.s_pb[j] = semiring_plus(w.s_pb[j], w.s_pb[i], use_max); w.s_pb[i] = -INFINITY; }
    }
    long long n_out = 0;
    for (int r = 0; r < nbest && r < nb; r++) {                        // the n best, walked back
        int k = -1;
        for (int i = 0; i < nb; i++) if (w.s_pb[i] > -INFINITY && (k < 0 || w.s_pb[i] > w.s_pb[k])) k = i;
        if (k < 0) break;
        const long long o = (long long)b * nbest + r;
        out_score[o] = w.s_pb[k]; w.s_pb[k] = -INFINITY;
        int L = 0, top = w.b_node[k];
        if (merge && top != 0 && kind[w.tok[top]] == 1) top = w.parent[top];   // (its words)
        for (int nd = top; nd != 0; nd = w.parent[nd]) L++;
        out_len[o] = L;
        int j = L - 1;
        for (int nd = top; nd != 0; nd = w.parent[nd]) out_tokens[o * T + j--] = w.tok[nd];
        n_out++;
    }
    out_n[b] = n_out;
}
