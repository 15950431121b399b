/* The CUDA entry points of libtorch_cuda.so that torchaudio 2.11 references; each reports failure. */
int aoti_torch_get_current_cuda_stream(void) { return 1; }
int torch_c10_cuda_check_msg(void) { return 1; }
int torch_c10_cuda_free_error_msg(void) { return 1; }
int torch_cuda_stream_synchronize(void) { return 1; }
int torch_get_cuda_stream_from_pool(void) { return 1; }
int torch_set_current_cuda_stream(void) { return 1; }
