// Indices in 3D, static and dynamic shared memory together, atomics.
extern "C" __global__ void write_indices(int* out) {   // out[global linear thread id] = packed (block, thread) ids
    const int b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const int t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    const int nt = blockDim.x * blockDim.y * blockDim.z;
    out[b * nt + t] = ((blockIdx.x * 4 + blockIdx.y) * 4 + blockIdx.z) * 1000 + (threadIdx.x * 4 + threadIdx.y) * 4 + threadIdx.z;
}
extern "C" __global__ void reverse_rows(const double* x, double* out, int cols) {  // static + dynamic shared
    __shared__ int row_offset;
    extern __shared__ double row[];
    if (threadIdx.x == 0) row_offset = blockIdx.x * cols;
    __syncthreads();
    for (int c = threadIdx.x; c < cols; c += blockDim.x) row[c] = x[row_offset + c];
    __syncthreads();
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[row_offset + c] = row[cols - 1 - c];
}
extern "C" __global__ void histogram(const int* x, int n, int* counts, float* weights, unsigned* max_value) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        atomicAdd(&counts[x[i]], 1);
        atomicAdd(&weights[x[i]], 0.5f);
        atomicMax(max_value, (unsigned)x[i]);
    }
}
extern "C" __global__ void cas_max(const float* x, int n, float* best) {  // float max through atomicCAS
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int* addr = (int*)best;
    int old = *addr, assumed;
    do {
        assumed = old;
        if (__int_as_float(assumed) >= x[i]) break;
        old = atomicCAS(addr, assumed, __float_as_int(x[i]));
    } while (assumed != old);
}
extern "C" __global__ void scalars(double* out, long long a, unsigned b, float c, bool d, short e) {
    out[0] = (double)a; out[1] = b; out[2] = c; out[3] = d; out[4] = e;
}
