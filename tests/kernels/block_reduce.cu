// Tree reduction in shared memory, one block per row. SYNC is the barrier between the halving steps; the tests
// define it empty to plant the missing-__syncthreads bug.
#ifndef SYNC
#define SYNC __syncthreads()
#endif
extern "C" __global__ void block_sum(const float* x, float* out, int cols) {
    __shared__ float partial[256];
    const int tx = threadIdx.x;
    float acc = 0.f;
    for (int c = tx; c < cols; c += blockDim.x) acc += x[blockIdx.x * cols + c];
    partial[tx] = acc;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (tx < half) partial[tx] += partial[tx + half];
        SYNC;
    }
    if (tx == 0) out[blockIdx.x] = partial[0];
}
