// A block's bitonic sort of positions (written by nbs/05b_koi.ipynb): koi's beam search and the CTC prefix beam
// search (cuda/beam.cu, cuda/ctc_beam.cu) sort their candidates with it.
#pragma once

// Sort order[0, P) ascending by `before` (a strict order in which every key is distinct; positions >= n come last).
template <class Before>
__device__ void block_sort(int* order, int n, int P, Before before) {
    for (int i = threadIdx.x; i < P; i += blockDim.x) order[i] = i;
    __syncthreads();
    for (int k = 2; k <= P; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < P; i += blockDim.x) {
                const int l = i ^ j;
                if (l <= i) continue;
                const int a = order[i], b = order[l];
                const bool a_first = a < n && (b >= n || before(a, b));
                if ((i & k) == 0 ? !a_first : a_first) { order[i] = b; order[l] = a; }
            }
            __syncthreads();
        }
}
