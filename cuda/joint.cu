// The per-tile kernels of the fused joint + RNN-T loss on the GPU (written by nbs/06b_joint.ipynb). A tile is a run of
// frames f0 <= f < f0 + nf of the padded grid flattened (f = b T + t, B T frames of U+1 rows each), with the rows
// u0 <= u < u0 + uu of each frame: all U+1 of them, or a part of one frame's. Row r of a tile is node
// (f0 + r / uu, u0 + r % uu); each kernel finds the row's utterance b = f / T, so one launch covers the frames of
// several utterances. Macros: FLOAT (float or double), JOINT_BLOCK (the most threads a block has).
#include "semiring.cuh"

// Row r's utterance, frame and label row, and the index of its node in the (B, T, U+1) tensors (64-bit: B T (U+1)
// passes 2^31 / V at training sizes).
struct JointRow { int b, t, u; long long node; };
__device__ __forceinline__ JointRow joint_row(long long r, int f0, int u0, int uu, int T, int U1) {
    const int f = f0 + (int)(r / uu), u = u0 + (int)(r % uu);
    return {f / T, f % T, u, (long long)f * U1 + u};
}

// Logit v of a row: the GEMM's h W^T plus the bias, if any.
__device__ __forceinline__ FLOAT joint_logit(const FLOAT* row, const FLOAT* bias, int has_bias, int v) {
    return has_bias ? row[v] + bias[v] : row[v];
}

// h[r] = act(e[b, t] + p[b, u]) at a node inside its lattice (t < T_b, u <= U_b), 0 outside: the padding of e (B, T, H)
// and p (B, U+1, H) is never read (it may hold anything). act: 0 identity, 1 relu (NaN stays NaN, as torch.relu), 2
// tanh. One block per row, its threads striding over the H columns.
extern "C" __global__ void joint_tile_act(
    const FLOAT* __restrict__ e, const FLOAT* __restrict__ p, const long long* __restrict__ logit_lengths,
    const long long* __restrict__ target_lengths, FLOAT* __restrict__ h, int act, int f0, int u0, int uu, int T,
    int U1, int H)
{
    const JointRow x = joint_row(blockIdx.x, f0, u0, uu, T, U1);
    const bool inside = x.t < logit_lengths[x.b] && x.u <= target_lengths[x.b];
    const FLOAT* er = e + ((long long)x.b * T + x.t) * H;
    const FLOAT* pr = p + ((long long)x.b * U1 + x.u) * H;
    FLOAT* hr = h + (long long)blockIdx.x * H;
    for (int k = threadIdx.x; k < H; k += blockDim.x) {
        FLOAT y = 0;
        if (inside) {
            y = er[k] + pr[k];
            if (act == 1) y = y < 0 ? (FLOAT)0 : y;
            else if (act == 2) y = tanh(y);
        }
        hr[k] = y;
    }
}

// With z[r] = h W^T + bias: lse[node] = log sum_v exp(z[r, v]), and the log-probabilities of the node's blank and
// label edges, edge_lp[node] = (z[r, blank] - lse, z[r, y[b, u]] - lse); y (B, U+1) holds blank past a target's length.
extern "C" __global__ void joint_tile_stats(
    const FLOAT* __restrict__ z, const FLOAT* __restrict__ bias, const long long* __restrict__ targets,
    double* __restrict__ lse, double* __restrict__ edge_lp, int has_bias, int f0, int u0, int uu, int T, int U1, int V,
    int blank)
{
    __shared__ FLOAT max_slots[32];
    __shared__ double sum_slots[32];
    const JointRow x = joint_row(blockIdx.x, f0, u0, uu, T, U1);
    const FLOAT* row = z + (long long)blockIdx.x * V;
    FLOAT m = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) m = max2(m, joint_logit(row, bias, has_bias, v));
    m = block_reduce<true>(m, max_slots);
    double s = 0;
    if (m > -INFINITY) for (int v = threadIdx.x; v < V; v += blockDim.x) s += exp(joint_logit(row, bias, has_bias, v) - m);
    s = block_reduce<false>(s, sum_slots);
    if (threadIdx.x == 0) {
        const double l = m == -INFINITY ? (double)m : m + log(s);
        lse[x.node] = l;
        edge_lp[2 * x.node] = joint_logit(row, bias, has_bias, blank) - l;
        edge_lp[2 * x.node + 1] = joint_logit(row, bias, has_bias, (int)targets[(long long)x.b * U1 + x.u]) - l;
    }
}

// z[r] (+ bias) becomes g[b] * d cost_b / dz[r] = g_b ((pb + pe) softmax - pb [blank] - pe [label]), clamped to
// [-clamp, clamp] before the scaling if clamp > 0, pe scaled by 1 + lam (FastEmit); zeros outside the lattice (so
// those rows add nothing to dW, db, de or dp). post (B, T, U+1, 2): the edges' posteriors. Each thread reads and
// writes its own columns: in place is safe.
extern "C" __global__ void joint_tile_grad(
    FLOAT* __restrict__ z, const FLOAT* __restrict__ bias, const long long* __restrict__ targets,
    const long long* __restrict__ logit_lengths, const long long* __restrict__ target_lengths,
    const double* __restrict__ lse, const double* __restrict__ post, const double* __restrict__ g, int has_bias,
    int f0, int u0, int uu, int T, int U1, int V, int blank, double clamp, double lam)
{
    const JointRow x = joint_row(blockIdx.x, f0, u0, uu, T, U1);   // no barrier in this kernel: early exits are safe
    FLOAT* row = z + (long long)blockIdx.x * V;
    const int Tb = (int)logit_lengths[x.b], Ub = (int)target_lengths[x.b];
    if (x.t >= Tb || x.u > Ub) {
        for (int v = threadIdx.x; v < V; v += blockDim.x) row[v] = 0;
        return;
    }
    const double pb = post[2 * x.node], pe = post[2 * x.node + 1] * (1 + lam), l = lse[x.node], gb = g[x.b];
    const long long label = x.u < Ub ? targets[(long long)x.b * U1 + x.u] : -1;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        double y = (pb + pe) * (double)exp((FLOAT)(joint_logit(row, bias, has_bias, v) - l));
        if (v == blank) y -= pb;
        if (v == label) y -= pe;
        if (clamp > 0) y = y < -clamp ? -clamp : (y > clamp ? clamp : y);
        row[v] = (FLOAT)(y * gb);
    }
}

// The activation's backward, summed: with d = act'(h) dh (relu': [h > 0], tanh': 1 - h^2, from the output h), de[f]
// += sum_u d[f, u] for each frame f of the tile, and dp[b, u] += sum_f d[f, u] over the tile's frames of each
// utterance b it spans. A block owns 32 columns of one sum (blocks i < nf: frame f0 + i; then one per utterance and
// row): its warps take every (blockDim.x / 32)-th term, in double, and the first adds the warps' sums in order. One
// writer per sum, a fixed order: deterministic, no atomics.
extern "C" __global__ void joint_tile_backprop(
    const FLOAT* __restrict__ dh, const FLOAT* __restrict__ h, FLOAT* __restrict__ de, FLOAT* __restrict__ dp, int act,
    int f0, int nf, int u0, int uu, int T, int U1, int H)
{
    __shared__ double part[JOINT_BLOCK];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32, chunks = (H + 31) / 32;
    const int i = blockIdx.x / chunks, k = (blockIdx.x % chunks) * 32 + lane;
    long long first, stride;                      // term m of the sum is row first + m * stride
    int count;
    FLOAT* out;
    if (i < nf) { first = (long long)i * uu; stride = 1; count = uu; out = de + (long long)(f0 + i) * H; }
    else {
        const int b = f0 / T + (i - nf) / uu, j = (i - nf) % uu;
        const int fa = max(f0, b * T), fb = min(f0 + nf, (b + 1) * T);   // the tile's frames of utterance b
        first = (long long)(fa - f0) * uu + j; stride = uu; count = fb - fa;
        out = dp + ((long long)b * U1 + u0 + j) * H;
    }
    double s = 0;
    if (k < H) for (int m = warp; m < count; m += warps) {
        const long long n = (first + m * stride) * H + k;
        double d = dh[n];
        if (act == 1) d = h[n] > 0 ? d : 0.0;
        else if (act == 2) d *= 1.0 - (double)h[n] * (double)h[n];
        s += d;
    }
    part[threadIdx.x] = s;
    __syncthreads();
    if (warp == 0 && k < H) {
        for (int w = 1; w < warps; w++) s += part[w * 32 + lane];
        out[k] += (FLOAT)s;
    }
}
