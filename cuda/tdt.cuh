// What tdt.cu and tdt_questions.cu share: the lattice's indexing and edge scores (written by 09_tdt.ipynb).
#pragma once
#include "transducer.cuh"      // node_index (64-bit: B * T * (U+1) * (V + D) passes 2^31), the wavefront

#define MAX_EDGES 72   // 2 * MAX_DURATIONS edge kinds, plus the RNN-T lattice's two


// The score of edge e leaving node n = (b, t, u): the token's log-probability (the target label y[u] for a label edge)
// minus its lattice's sigma, plus the duration's log-probability, plus the delay offset (label edges).
__device__ __forceinline__ double edge_score(const FLOAT* x, const double* lse, const long long* y, const int* e,
    long long n, int t, int u, int Tb, int V, int W, double sigma0, double sigma1, double delay_penalty)
{
    const long long c = e[1] ? y[u] : e[3];
    double s = (double)x[n * W + c] - lse[2 * n] - (e[0] ? sigma1 : sigma0);
    if (e[4] >= 0) s += (double)x[n * W + V + e[4]] - lse[2 * n + 1];
    if (e[1]) s += delay_penalty * (0.5 * (Tb - 1) - t);
    return s;
}
