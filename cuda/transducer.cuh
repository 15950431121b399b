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

// Node n of the padded (B, T, U+1) grid as the thread-a-node kernels of the lattice questions take it: its sequence,
// frame and row, its lattice's size, the sequence's (log Z_p, log Z_q, accumulator) (out[3 b ...]), and whether it
// has work: inside its lattice (t < T_b, u <= U_b) of a sequence with a path (neither log Z -inf).
struct LatticeNode { int b, t, u, Tb, Ub; double zp, zq, total; bool live; };
__device__ __forceinline__ LatticeNode lattice_node(long long n, int T, int U1, const long long* logit_lengths,
                                                    const long long* target_lengths, const double* out) {
    LatticeNode x;
    x.u = (int)(n % U1); x.t = (int)(n / U1 % T); x.b = (int)(n / U1 / T);
    x.Tb = (int)logit_lengths[x.b]; x.Ub = (int)target_lengths[x.b];
    x.zp = out[3 * x.b]; x.zq = out[3 * x.b + 1]; x.total = out[3 * x.b + 2];
    x.live = x.t < x.Tb && x.u <= x.Ub && x.zp != -INFINITY && x.zq != -INFINITY;
    return x;
}
