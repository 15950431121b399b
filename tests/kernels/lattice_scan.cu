// The recursion of the lattice kernels in miniature: alpha[t+1, s] = x[t, s] * (alpha[t, s] + alpha[t, s-1]) in a
// semiring, states over threads, a looping path when there are more states than threads, and the previous step
// kept in shared memory. NBUF=2 double-buffers it (one barrier a step suffices); the tests set NBUF=1 to plant
// the race where a thread overwrites a value that its neighbour has not read yet.
#include "semiring.cuh"
#ifndef NBUF
#define NBUF 2
#endif
extern "C" __global__ void lattice_forward(const FLOAT* __restrict__ x, FLOAT* __restrict__ alpha, int T, int S) {
    extern __shared__ FLOAT buf[];   // NBUF * S values
    const int n = blockIdx.x;
    const FLOAT* xn = x + (long long)n * T * S;
    FLOAT* an = alpha + (long long)n * (T + 1) * S;
    for (int s = threadIdx.x; s < S; s += blockDim.x) { buf[s] = s == 0 ? ONE : ZERO; an[s] = buf[s]; }
    __syncthreads();
    for (int t = 0; t < T; t++) {
        const FLOAT* prev = buf + (t % NBUF) * S;
        FLOAT* next = buf + ((t + 1) % NBUF) * S;
        for (int s = threadIdx.x; s < S; s += blockDim.x) {
            FLOAT a = s > 0 ? SUM(prev[s], prev[s - 1]) : prev[s];
            a = MUL(xn[t * S + s], a);
            next[s] = a;
            an[(t + 1) * S + s] = a;
        }
        __syncthreads();
    }
}
