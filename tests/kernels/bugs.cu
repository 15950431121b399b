// Kernels with planted bugs: each must give a clear error from the emulator, never a hang or a crash.
extern "C" __global__ void divergent_barrier(float* out) {   // only half the block reaches the barrier
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1.f;
}
extern "C" __global__ void two_barriers(float* out) {        // the halves wait at different barriers
    if (threadIdx.x % 2) { __syncthreads(); out[threadIdx.x] = 1.f; }
    else { __syncthreads(); out[threadIdx.x] = 2.f; }
}
extern "C" __global__ void early_return(const float* x, float* out, int n) {  // seqdist 0.0.3's pattern
    extern __shared__ float buf[];
    if (threadIdx.x >= n) return;
    buf[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = buf[(threadIdx.x + 1) % n];
}
extern "C" __global__ void read_past_end(const float* x, float* out, int n) {  // one element too many
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i % n] = x[i];
}
extern "C" __global__ void write_past_end(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = 1.f;
}
extern "C" __global__ void write_before_start(float* out, int n) {
    const int i = threadIdx.x;
    if (i < n) out[i - 1] = 1.f;
}
extern "C" __global__ void shared_past_end(float* out) {     // dynamic shared memory of blockDim.x floats
    extern __shared__ float buf[];
    buf[threadIdx.x + 1] = 1.f;
    __syncthreads();
    out[threadIdx.x] = buf[threadIdx.x];
}
extern "C" __global__ void null_write(float* out) { out[threadIdx.x] = 1.f; }
extern "C" __global__ void failed_assert(const int* x) { assert(x[threadIdx.x] >= 0); }
