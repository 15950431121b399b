"""The bad-input tables under the sanitizers, in a pytest subprocess: the emulated CUDA kernels built with
AddressSanitizer (SEQDIST_SANITIZE=1, which every process's emulator reads, libasan preloaded) and the numba CPU kernels compiled with their
bounds checks (NUMBA_BOUNDSCHECK=1: an index outside an array raises IndexError instead of reading or writing memory
no one owns). `make sanitize` runs every row; `--sample` the rows `make test` runs (tests/test_asan.py): the k-best
kernel fed NaN directly, and the CTC and transducer rows of the NaN table, through the CPU and the emulated kernels.
Extra arguments go to pytest."""
import subprocess, sys
from seqdist.emulator import asan_environment

TABLES = ['tests/test_bad_input.py', 'tests/test_nan_semantics.py', 'tests/test_nonfinite.py', 'tests/test_declared.py',
          'tests/test_declared_more.py']
SAMPLE = ['tests/test_nonfinite.py', 'tests/test_nan_semantics.py', '-k',
          'kernel_fed_nan or ((ctc_loss or rnnt_loss or tdt_loss) and (cpu or cuda))']

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    sample = '--sample' in argv
    rest = [a for a in argv if a != '--sample']
    env = dict(asan_environment(), SEQDIST_SANITIZE='1', NUMBA_BOUNDSCHECK='1')
    cmd = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *(SAMPLE if sample else TABLES), *rest]
    return subprocess.run(cmd, env=env).returncode

if __name__ == '__main__': sys.exit(main())
