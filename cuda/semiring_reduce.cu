// Semiring sum of each row of a matrix (written by nbs/01_utils.ipynb): the example kernel of the toolchain.
#include "semiring.cuh"

// One block per row. Each thread folds a strided slice of the row; the warp then combines its 32 partial sums
// with shuffles, and warp 0 combines the per-warp sums left in shared memory. blockDim.x is a multiple of 32.
extern "C" __global__ void semiring_sum_rows(const FLOAT* __restrict__ x, FLOAT* __restrict__ out, int rows, int cols) {
    extern __shared__ FLOAT warp_sums[];  // one per warp
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    const FLOAT* row = x + (long long)blockIdx.x * cols;
    FLOAT acc = ZERO;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) acc = SUM(acc, row[c]);
    for (int offset = 16; offset > 0; offset /= 2) acc = SUM(acc, __shfl_down_sync(0xffffffff, acc, offset));
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();  // every warp's sum is in shared memory before warp 0 reads them
    if (warp == 0) {
        acc = lane < nwarps ? warp_sums[lane] : ZERO;
        for (int offset = 16; offset > 0; offset /= 2) acc = SUM(acc, __shfl_down_sync(0xffffffff, acc, offset));
        if (lane == 0) out[blockIdx.x] = acc;
    }
}
