// Warp-level primitives, each checked against numpy by the tests.
extern "C" __global__ void warp_sum_xor(const double* x, double* out) {   // butterfly: every lane gets the sum
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    double v = x[i];
    for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffff, v, m);
    out[i] = v;
}
extern "C" __global__ void warp_sum_down(const float* x, float* out) {   // lane 0 of each warp gets the sum
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    for (int d = 16; d > 0; d /= 2) v += __shfl_down_sync(0xffffffff, v, d);
    if (threadIdx.x % 32 == 0) out[i / 32] = v;
}
extern "C" __global__ void warp_scan_up(const int* x, int* out) {        // inclusive prefix sum within each warp
    const int i = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32;
    int v = x[i];
    for (int d = 1; d < 32; d *= 2) { int u = __shfl_up_sync(0xffffffff, v, d); if (lane >= d) v += u; }
    out[i] = v;
}
extern "C" __global__ void warp_broadcast(const float* x, const int* src, float* out, int width) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = __shfl_sync(0xffffffff, x[i], src[i], width);
}
extern "C" __global__ void warp_votes(const int* pred, unsigned* ballot, int* any, int* all) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int p = pred[i];
    unsigned b = __ballot_sync(0xffffffff, p);
    int a = __any_sync(0xffffffff, p), l = __all_sync(0xffffffff, p);
    __syncwarp();
    ballot[i] = b; any[i] = a; all[i] = l;
}
extern "C" __global__ void half_warps(const float* x, float* out) {     // two groups of 16 lanes, separate masks
    const int lane = threadIdx.x % 32;
    float v = x[threadIdx.x];
    if (lane < 16) v += __shfl_xor_sync(0x0000ffff, v, 1);
    else v += __shfl_xor_sync(0xffff0000, v, 2);
    out[threadIdx.x] = v;
}
extern "C" __global__ void diverged_shuffles(const float* x, float* out) {  // lanes at different warp operations
    float v = x[threadIdx.x];
    if (threadIdx.x % 2) v = __shfl_xor_sync(0xffffffff, v, 1);
    else v = __shfl_down_sync(0xffffffff, v, 1);
    out[threadIdx.x] = v;
}
extern "C" __global__ void shuffle_outside_mask(const float* x, float* out) {  // reads a lane the mask leaves out
    float v = x[threadIdx.x];
    if (threadIdx.x < 16) v = __shfl_down_sync(0x0000ffff, v, 8);
    out[threadIdx.x] = v;
}
