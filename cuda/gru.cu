// The GRU's fused gate kernels, forward and backward of one time step (written by nbs/07_gru.ipynb).
// cuDNN's (and PyTorch's) GRU: r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r * gh_n),
// h' = (1 - z) n + z h, where gi = W_i x + b_i and gh = W_h h + b_h come from GEMMs. One thread per (sequence b,
// hidden unit j): the three gates of unit j are independent of every other unit once the GEMMs are done, so the
// step needs no shared memory and no barrier. ACC is the arithmetic type (float for float, double for double).
#ifndef ACC
#define ACC FLOAT
#endif

template <class T> __device__ __forceinline__ T sigmoid_(T x) { return T(1) / (T(1) + exp(-x)); }

// G[t] (N, 3H): gi in, r z n out. gh (N, 3H). Hb[src] = h, Hb[dst] = h'. ghn[t] = gh_n, kept for the backward.
extern "C" __global__ void gru_gates_forward(
    FLOAT* __restrict__ G, const FLOAT* __restrict__ gh, FLOAT* __restrict__ Hb, FLOAT* __restrict__ ghn,
    const long long* __restrict__ lengths, int t, int src, int dst, int N, int H)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * H) return;
    const long long b = i / H, j = i % H;
    const ACC hp = Hb[(long long)src * N * H + i];
    FLOAT* h_out = Hb + (long long)dst * N * H + i;
    if (t >= lengths[b]) { *h_out = hp; return; }          // finished, or (in reverse) not yet started
    FLOAT* g = G + ((long long)t * N + b) * 3 * H;
    const FLOAT* q = gh + b * 3 * H;
    const ACC r = sigmoid_<ACC>((ACC)g[j] + (ACC)q[j]);
    const ACC z = sigmoid_<ACC>((ACC)g[H + j] + (ACC)q[H + j]);
    const ACC a = q[2 * H + j];
    const ACC n = tanh((ACC)g[2 * H + j] + r * a);
    g[j] = r; g[H + j] = z; g[2 * H + j] = n;
    ghn[(long long)t * N * H + i] = a;
    *h_out = n + z * (hp - n);
}

// dh (N, H): the gradient reaching h' from later steps, plus the direct gradient dHb[dst]. Writes dgh[t] (N, 3H) =
// d(gh), dan[t] (N, H) = d(gi_n), and dh_prev = d * z; the caller adds dgh[t] W_hh with a GEMM.
extern "C" __global__ void gru_gates_backward(
    const FLOAT* __restrict__ G, const FLOAT* __restrict__ ghn, const FLOAT* __restrict__ Hb,
    const FLOAT* __restrict__ dHb, const FLOAT* __restrict__ dh, FLOAT* __restrict__ dh_prev,
    FLOAT* __restrict__ dgh, FLOAT* __restrict__ dan, const long long* __restrict__ lengths,
    int t, int src, int dst, int N, int H)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * H) return;
    const long long b = i / H, j = i % H;
    const ACC d = (ACC)dh[i] + (ACC)dHb[(long long)dst * N * H + i];
    FLOAT* dg = dgh + ((long long)t * N + b) * 3 * H;
    const long long k = (long long)t * N * H + i;
    if (t >= lengths[b]) {
        dh_prev[i] = d; dg[j] = 0; dg[H + j] = 0; dg[2 * H + j] = 0; dan[k] = 0;
        return;
    }
    const FLOAT* g = G + ((long long)t * N + b) * 3 * H;
    const ACC r = g[j], z = g[H + j], n = g[2 * H + j], hp = Hb[(long long)src * N * H + i];
    const ACC da_n = d * (ACC(1) - z) * (ACC(1) - n * n);
    const ACC da_r = da_n * (ACC)ghn[k] * r * (ACC(1) - r);
    const ACC da_z = d * (hp - n) * z * (ACC(1) - z);
    dg[j] = da_r; dg[H + j] = da_z; dg[2 * H + j] = da_n * r;
    dan[k] = da_n;
    dh_prev[i] = d * z;
}
