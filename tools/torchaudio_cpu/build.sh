#!/usr/bin/env bash
# Builds the libraries that let PyPI's torchaudio wheel (a CUDA 13 build) load next to a CPU-only torch, into $1.
# seqdist.timing.load_torchaudio preloads them from <venv>/cuda-stubs. Tests and benchmarks only.
set -euo pipefail
mkdir -p "$1"; out=$(cd "$1" && pwd); cd "$(dirname "$0")"
gcc -shared -fPIC -o "$out/libcudart.so.13" -Wl,-soname,libcudart.so.13 -Wl,--version-script=cudart.map cudart.c
gcc -shared -fPIC -o "$out/libtorch_cuda.so" -Wl,-soname,libtorch_cuda.so torch_cuda.c
gcc -shared -fPIC -o "$out/libc10_cuda.so" -Wl,-soname,libc10_cuda.so c10_cuda.c
