"""AddressSanitizer in a subprocess: it reports an out-of-bounds write into a PyTorch tensor and an overflow of a
static __shared__ array (which the in-process guard pages cannot see)."""
import os, pathlib, shutil, subprocess, sys, pytest
from seqdist.utils import asan_environment, run_under_asan, emulator_options, load_kernel
from conftest import KERNELS

try: asan_environment(); has_asan = True
except RuntimeError: has_asan = False
needs_asan = pytest.mark.skipif(not has_asan, reason="no AddressSanitizer runtime for the host compiler")

LAUNCH = """
import torch
from seqdist.utils import load_kernel
k = load_kernel({path!r}, {name!r})
k((1,), (32,), {args})
print('launched')
"""

@needs_asan
def test_asan_reports_a_write_past_the_end_of_a_tensor(tmp_path):
    rc, err = run_under_asan(LAUNCH.format(path=str(KERNELS / 'bugs.cu'), name='write_past_end', args='(torch.zeros(10), 10)'))
    assert rc != 0 and 'heap-buffer-overflow' in err and '0 bytes after 40-byte region' in err.replace('to the right of', 'after'), err[-3000:]

@needs_asan
def test_asan_reports_a_static_shared_overflow(tmp_path):
    (tmp_path / 'static_overflow.cu').write_text(
        'extern "C" __global__ void k(float* out) {\n  __shared__ float s[32];\n  s[threadIdx.x + 1] = 1.f;\n'
        '  __syncthreads();\n  out[threadIdx.x] = s[threadIdx.x];\n}\n')
    rc, err = run_under_asan(LAUNCH.format(path=str(tmp_path / 'static_overflow.cu'), name='k', args='(torch.zeros(32),)'))
    assert rc != 0 and 'global-buffer-overflow' in err, err[-3000:]

@needs_asan
def test_asan_is_quiet_on_a_correct_kernel():
    rc, err = run_under_asan(LAUNCH.format(path=str(KERNELS / 'warp_ops.cu'), name='warp_sum_xor',
                                           args='(torch.randn(32, dtype=torch.float64), torch.empty(32, dtype=torch.float64))'))
    assert rc == 0 and 'ERROR: AddressSanitizer' not in err, err[-3000:]

def test_sanitize_without_the_runtime_is_a_clear_error():
    with emulator_options(sanitize=True), pytest.raises(RuntimeError, match="needs AddressSanitizer's runtime loaded first"):
        import torch
        load_kernel(KERNELS / 'block_reduce.cu', 'block_sum', ASAN_PROBE=1)((1,), (32,), (torch.zeros(4), torch.zeros(1), 4))

REPO = pathlib.Path(__file__).parent.parent

def test_numba_bounds_checks_catch_a_write_past_the_end():
    "The CPU kernels' half of the sweep: under NUMBA_BOUNDSCHECK=1 a numba write past an array raises IndexError."
    code = ("import numba, numpy as np\n@numba.njit(nogil=True)\ndef fill(a, n):\n    for i in range(n + 1): a[i] = 1.0\n"
            "fill(np.zeros(4), 4)\nprint('wrote past the end')")
    r = subprocess.run([sys.executable, '-c', code], env={**os.environ, 'NUMBA_BOUNDSCHECK': '1'}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and 'IndexError' in r.stderr and 'wrote past the end' not in r.stdout, r.stderr[-2000:]

@needs_asan
def test_a_sample_of_the_bad_input_tables_runs_clean_under_the_sanitizers():
    """tools/sanitize.py --sample: the k-best kernel fed NaN directly, and the NaN table's CTC and transducer rows on the
    CPU kernels (bounds-checked) and the emulated CUDA kernels (AddressSanitizer); `make sanitize` runs every row."""
    r = subprocess.run([sys.executable, 'tools/sanitize.py', '--sample', '-x'], cwd=REPO, capture_output=True, text=True,
                       timeout=1200)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and 'ERROR: AddressSanitizer' not in out and ' passed' in out, out[-4000:]

@needs_asan
def test_the_sanitizer_reports_a_misaligned_load(tmp_path):
    "A double read at an address that is not a multiple of 8: a GPU faults (misaligned address), x86 does not; UBSan's alignment check does."
    (tmp_path / 'misaligned.cu').write_text(
        'extern "C" __global__ void k(const unsigned char* p, double* out) {\n'
        '  out[threadIdx.x] = *(const double*)(p + 8 * threadIdx.x + 4);\n}\n')
    rc, err = run_under_asan(LAUNCH.format(path=str(tmp_path / 'misaligned.cu'), name='k',
                                           args='(torch.zeros(512, dtype=torch.uint8), torch.zeros(32, dtype=torch.float64))'))
    assert rc != 0 and 'misaligned address' in err, err[-3000:]

@needs_asan
def test_the_cuda_beam_search_scratch_is_aligned():
    """ctc_beam_search's CUDA kernel (emulated) over three utterances, alone, with hotwords and with words: each one's scratch
    starts 256-byte aligned (it was work_bytes apart, not a multiple of 8: a misaligned-address fault on the H200, for
    the second utterance on), and the last one's stays inside the buffer."""
    rc, err = run_under_asan(
        "import torch\nfrom seqdist.decode import ctc_beam_search\n"
        "lp = torch.randn(3, 9, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).log_softmax(-1)\n"
        "print(ctc_beam_search(lp, torch.tensor([9, 5, 3]), beam_width=3, nbest=2, backend='cuda'))\n"
        "print(ctc_beam_search(lp, torch.tensor([9, 5, 3]), beam_width=3, nbest=2, backend='cuda', hotwords=[[1, 2], [3]]))\n"
        "print(ctc_beam_search(lp, torch.tensor([9, 5, 3]), beam_width=3, nbest=2, backend='cuda', tokens=list('-ab|cde')))\n")
    assert rc == 0 and 'runtime error' not in err, err[-3000:]
