// The (T, U+1) lattice of the transducers, RNN-T's and TDT's (written by nbs/06_rnnt.ipynb): where a node lives, and the
// wavefront their kernels walk it in.
#pragma once
#include "semiring.cuh"

// Offsets are 64-bit: B * T * (U+1) * V passes 2^31 at the sizes people train with.
__device__ __forceinline__ long long node_index(int b, int t, int u, int T, int U1) {
    return ((long long)b * T + t) * U1 + u;
}

// The nodes (t, u) of anti-diagonal d (t + u = d) of a sequence's (Tb, Ub+1) lattice, dealt to the block's threads in
// turn: a node depends only on nodes of earlier diagonals, so one diagonal's nodes are computed at once, a barrier
// between diagonals. `FOR_EACH_NODE_OF_DIAGONAL(d, t, u) { ... }` declares t and u for the body (Tb, Ub in scope).
#define FOR_EACH_NODE_OF_DIAGONAL(d, t, u) \
    for (int u = threadIdx.x; u <= Ub; u += blockDim.x) \
        if (const int t = (d) - u; t >= 0 && t < Tb)
