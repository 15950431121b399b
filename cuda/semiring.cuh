// Semiring sums for seqdist's kernels (written by nbs/00_core.ipynb). A kernel is specialised to a semiring by
// the macros FLOAT, ZERO, ONE, MUL(a, b), SUM(a, b), SUM3(a, b, c) (see seqdist.core.semiring.cuda_macros).
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
