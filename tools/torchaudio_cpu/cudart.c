/* libcudart.so.13 for a machine without CUDA: PyPI's torchaudio wheel is a CUDA build whose library needs these
   symbols to load. Registration hooks do nothing; every runtime call answers cudaErrorNoDevice (100), so the CPU
   kernels run and any CUDA call fails cleanly. Used by tests and benchmarks only. */
static void *handle[4];
void **__cudaRegisterFatBinary(void *fatbin) { (void)fatbin; return handle; }
void __cudaRegisterFatBinaryEnd(void **h) { (void)h; }
void __cudaUnregisterFatBinary(void **h) { (void)h; }
void __cudaRegisterFunction(void) {}
void __cudaRegisterVar(void) {}
int __cudaPopCallConfiguration(void) { return 100; }
unsigned __cudaPushCallConfiguration(void) { return 100; }
int __cudaGetKernel(void) { return 100; }
int __cudaLaunchKernel(void) { return 100; }
int cudaGetLastError(void) { return 100; }
int cudaMemcpyAsync(void) { return 100; }
int cudaMemset(void) { return 100; }
int cudaSetDevice(void) { return 100; }
