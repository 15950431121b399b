// Semiring sums for seqdist's kernels, and a block-wide reduction (written by nbs/00_core.ipynb). A kernel is
// specialised to a semiring by the macros FLOAT, ZERO, ONE, MUL(a, b), SUM(a, b), SUM3(a, b, c) (see
// seqdist.core.semiring.cuda_macros).
#pragma once

#ifndef INFINITY   // NVRTC compiles without the C math headers
#define INFINITY __int_as_float(0x7f800000)
#endif

template <class T> __device__ __forceinline__ T max2(T a, T b) { return a > b ? a : b; }
template <class T> __device__ __forceinline__ T max3(T a, T b, T c) { return max2(max2(a, b), c); }

template <class T> __device__ __forceinline__ T logsumexp2(T a, T b) {
    T m = max2(a, b);
    return m + log(exp(a - m) + exp(b - m));
}
template <class T> __device__ __forceinline__ T logsumexp3(T a, T b, T c) {
    T m = max3(a, b, c);
    return m + log(exp(a - m) + exp(b - m) + exp(c - m));
}

// The max (IS_MAX) or the sum of x over the threads of the block, returned to every thread: shuffles within each
// warp, then one value per warp through `slots` (32 of them, in shared memory) and shuffles again. Every thread of
// the block calls it, blockDim.x a multiple of 32.
template <bool IS_MAX, class T> __device__ T block_reduce(T x, T* slots) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    for (int o = 16; o > 0; o /= 2) { T y = __shfl_xor_sync(0xffffffff, x, o); x = IS_MAX ? max2(x, y) : x + y; }
    __syncthreads();                          // the slots are free: a previous reduction has been read
    if (lane == 0) slots[warp] = x;
    __syncthreads();
    x = lane < nwarps ? slots[lane] : (IS_MAX ? (T)-INFINITY : (T)0);
    for (int o = 16; o > 0; o /= 2) { T y = __shfl_xor_sync(0xffffffff, x, o); x = IS_MAX ? max2(x, y) : x + y; }
    return x;
}
