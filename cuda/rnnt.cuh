// What rnnt.cu and rnnt_questions.cu share: the lattice's indexing and edge scores (written by 06_rnnt.ipynb).
#pragma once
#include "transducer.cuh"

__device__ __forceinline__ long long row_offset(int b, int t, int u, int T, int U1, int V) {
    return node_index(b, t, u, T, U1) * (long long)V;
}

// Log-probability of label k at node n: logits minus the row's log-sum-exp (0 if the logits are log-probs already).
__device__ __forceinline__ double edge_lp(const FLOAT* logits, const double* lse, long long n, int V, long long k) {
    return logits[n * V + k] - lse[n];
}

// k2's delay penalty: the offset added to the log-probability of the label edges of frame t (Tb frames in all).
__device__ __forceinline__ double delay_offset(double delay_penalty, int t, int Tb) {
    return delay_penalty * (0.5 * (Tb - 1) - t);
}
