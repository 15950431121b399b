// Fused cross-entropy rows (written by nbs/08_cross_entropy.ipynb): the forward keeps only the log-normaliser of
// each row; the backward recomputes the softmax straight into the gradient. One block per row (grid-stride), online
// max/sum per thread, combined by warp shuffles and shared memory. Macros: FLOAT (arithmetic), IN_T (storage),
// LOAD(v) (IN_T -> FLOAT), STORE(v) (FLOAT -> IN_T).
#include "semiring.cuh"

__device__ __forceinline__ FLOAT ce_capped(FLOAT v, FLOAT cap) { return cap > 0 ? cap * tanh(v / cap) : v; }

// (m, s) <- the max and the sum of exp(. - max) of the union of two sets.
__device__ __forceinline__ void ce_combine(FLOAT& m, FLOAT& s, FLOAT m2, FLOAT s2) {
    const FLOAT mx = max2(m, m2);
    if (mx == -INFINITY) return;
    s = s * exp(m - mx) + s2 * exp(m2 - mx);
    m = mx;
}

// Block-wide (m, s, sx) reduction; the result is valid in thread 0. `red` holds 3 * 32 values.
__device__ __forceinline__ void ce_block_reduce(FLOAT& m, FLOAT& s, FLOAT& sx, FLOAT* red) {
    for (int o = 16; o > 0; o /= 2) {
        const FLOAT m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        sx += __shfl_xor_sync(0xffffffffu, sx, o);
        ce_combine(m, s, m2, s2);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    if (lane == 0) { red[warp] = m; red[32 + warp] = s; red[64 + warp] = sx; }
    __syncthreads();
    if (warp == 0) {
        m = lane < nwarps ? red[lane] : -INFINITY;
        s = lane < nwarps ? red[32 + lane] : 0;
        sx = lane < nwarps ? red[64 + lane] : 0;
        for (int o = 16; o > 0; o /= 2) {
            const FLOAT m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
            sx += __shfl_xor_sync(0xffffffffu, sx, o);
            ce_combine(m, s, m2, s2);
        }
    }
    __syncthreads();                                   // red is reused by the next row
}

extern "C" __global__ void ce_forward(const IN_T* __restrict__ x, const long long* __restrict__ target,
                                      const FLOAT* __restrict__ weight, int has_weight, long long ignore_index,
                                      FLOAT eps, FLOAT cap, FLOAT W, FLOAT* __restrict__ lse, FLOAT* __restrict__ ce,
                                      int M, int C, bool* __restrict__ ok) {
    __shared__ FLOAT red[96];
    for (int row = blockIdx.x; row < M; row += gridDim.x) {
        const IN_T* r = x + (long long)row * C;
        FLOAT m = -INFINITY, s = 0, sx = 0;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const FLOAT v = ce_capped(LOAD(r[c]), cap);
            if (v > m) { s = s * exp(m - v) + 1; m = v; }
            else s += exp(v - m);
            if (eps > 0) sx += has_weight ? weight[c] * v : v;
        }
        ce_block_reduce(m, s, sx, red);
        if (threadIdx.x == 0) {
            const FLOAT z = m + log(s);
            const long long t = target[row];
            FLOAT loss = 0;
            if (t != ignore_index && (t < 0 || t >= C)) {       // a class out of range: NaN, and with `ok` the check's
                loss = (FLOAT)INFINITY - (FLOAT)INFINITY;      // flag (asserted on the device: `_check_targets`)
                if (ok) ok[0] = false;
            } else if (t != ignore_index) {
                const FLOAT wt = has_weight ? weight[t] : (FLOAT)1;
                loss = (1 - eps) * wt * (z - ce_capped(LOAD(r[t]), cap));
                if (eps > 0) loss += eps / C * (W * z - sx);
            }
            lse[row] = z;
            ce[row] = loss;
        }
    }
}

// grad = d/dx of sum_i (g_ce[i] ce[i] + g_lse[i] lse[i] + zc[i] lse[i]^2) (zc null: 0; g_step 0: g_ce a reduction's
// gradient, one value for every row, read as it is rather than copied out to M); grad may alias x. A target out of
// range (which the forward flagged) reads no weight. Bounded to 32 registers in float (8 blocks of 256 resident: a
// streaming pass needs its loads in flight; 33 left 6), 51 in double (5 blocks: 8 would spill).
#define CE_BACKWARD_MIN_BLOCKS (sizeof(FLOAT) == 4 ? 8 : 5)
extern "C" __global__ void __launch_bounds__(256, CE_BACKWARD_MIN_BLOCKS)
ce_backward(const IN_T* x, const long long* __restrict__ target, const FLOAT* __restrict__ weight, int has_weight,
            long long ignore_index, FLOAT eps, FLOAT cap, FLOAT W, const FLOAT* __restrict__ lse,
            const FLOAT* __restrict__ g_ce, const FLOAT* __restrict__ g_lse, const FLOAT* __restrict__ zc, IN_T* grad,
            int M, int C, long long g_step) {
    for (int row = blockIdx.x; row < M; row += gridDim.x) {
        const long long t = target[row];
        const bool ign = t == ignore_index, out = t < 0 || t >= C;
        const FLOAT z = lse[row], wt = ign || out ? (FLOAT)0 : (has_weight ? weight[t] : (FLOAT)1);
        const FLOAT g = ign ? (FLOAT)0 : g_ce[g_step ? row : 0];
        const FLOAT a = g * ((1 - eps) * wt + eps / C * W) + g_lse[row] + (zc ? 2 * zc[row] * z : (FLOAT)0);
        const FLOAT b = g * eps / C;
        const IN_T* r = x + (long long)row * C;
        IN_T* gr = grad + (long long)row * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const FLOAT v = ce_capped(LOAD(r[c]), cap);
            FLOAT d = a * exp(v - z) - b * (has_weight ? weight[c] : (FLOAT)1);
            if (c == t) d -= g * (1 - eps) * wt;
            if (cap > 0) d *= 1 - (v / cap) * (v / cap);
            gr[c] = STORE(d);
        }
    }
}
