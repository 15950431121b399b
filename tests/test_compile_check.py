"""The GPU compile check: NVRTC (or nvcc) compiles every instantiation for sm_80/sm_90, and reports a kernel that
only the emulator's host compiler accepts as a failure."""
import pytest, torch
from seqdist.core import Log, Max
from seqdist.utils import gpu_compiler, check_gpu_compile, package_kernels, load_kernel
from conftest import KERNELS as KDIR

name, compile_fn = gpu_compiler()
needs_compiler = pytest.mark.skipif(compile_fn is None, reason="no NVRTC or nvcc: the GPU compile check cannot run here")

def test_registry_lists_every_instantiation_of_the_package():
    ks = package_kernels()
    got = {(k.path.name, k.macros['FLOAT'], k.macros['SUM(a, b)']) for k in ks if k.name == 'semiring_sum_rows'}
    assert got == {('semiring_reduce.cu', f, s) for f in ('float', 'double') for s in ('logsumexp2(a, b)', 'max2(a, b)')}

@needs_compiler
def test_a_good_kernel_compiles_for_both_targets(capsys):
    k = load_kernel(KDIR / 'lattice_scan.cu', 'lattice_forward', **Max.cuda_macros(torch.float32))
    assert check_gpu_compile([k]) == []
    assert 'ok   sm_80' in capsys.readouterr().out

@needs_compiler
def test_host_only_code_fails_the_check(tmp_path, capsys):
    (tmp_path / 'host_only.cu').write_text(
        '#include <vector>\nextern "C" __global__ void k(float* x) { std::vector<float> v(3); x[0] = v.size(); }\n')
    k = load_kernel(tmp_path / 'host_only.cu', 'k')
    failures = check_gpu_compile([k], archs=('sm_80',))
    assert len(failures) == 1 and 'FAIL sm_80' in capsys.readouterr().out

@needs_compiler
def test_emulated_test_kernels_also_compile_for_gpus():
    ks = [load_kernel(KDIR / f, n) for f, n in [('block_reduce.cu', 'block_sum'), ('warp_ops.cu', 'warp_votes'),
                                               ('misc.cu', 'histogram'), ('bugs.cu', 'early_return')]]
    assert check_gpu_compile(ks) == []
