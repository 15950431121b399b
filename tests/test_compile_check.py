"""The GPU compile check: NVRTC (or nvcc) compiles every instantiation for sm_80/sm_90, and reports a kernel that
only the emulator's host compiler accepts as a failure."""
import re, pytest, torch
from seqdist.core import Log, Max
from seqdist.utils import (gpu_compiler, check_gpu_compile, package_kernels, load_kernel, parse_ptxas_log, Resources,
                           resident_threads, resource_rows, Budget, format_resource_table, EMULATOR_MAX_SHARED_MEM, cuda_dir)
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

# ptxas's `-v` report as NVRTC's program log gives it (sm_90, CUDA 12): one kernel that spills, one with static shared
# memory, one clean.
PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'spiller' for 'sm_90'
ptxas info    : Function properties for spiller
ptxas         .     304 bytes stack frame, 5508 bytes spill stores, 5668 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 304 bytes cumulative stack size
ptxas info    : Compile time = 3475.312 ms
ptxas info    : Compiling entry function 'reducer' for 'sm_90'
ptxas info    : Function properties for reducer
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 26 registers, used 1 barriers, 384 bytes smem
ptxas info    : Compiling entry function 'clean' for 'sm_90'
ptxas info    : Function properties for clean
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 18 registers, used 0 barriers
"""

def test_the_ptxas_report_is_parsed_per_kernel():
    r = parse_ptxas_log(PTXAS_LOG)
    assert r == {'spiller': Resources(32, 5508, 5668, 304, 0, 1), 'reducer': Resources(26, 0, 0, 0, 384, 1),
                 'clean': Resources(18, 0, 0, 0, 0, 0)}

def test_occupancy_from_registers_shared_memory_and_thread_limits():
    res = lambda regs, smem=0: Resources(regs, 0, 0, 0, smem, 1)
    assert resident_threads(res(32), 1024, 0, 'sm_90') == 2048             # threads limit: two blocks
    assert resident_threads(res(64), 1024, 0, 'sm_90') == 1024             # 64 x 1024 = the whole register file
    assert resident_threads(res(65), 1024, 0, 'sm_90') == 0                # cannot launch at all
    assert resident_threads(res(48), 1024, 0, 'sm_80') == 1024             # 40 warps by registers: one 32-warp block
    assert resident_threads(res(32), 256, 100 * 1024, 'sm_80') == 256      # shared memory: one block of 100 KiB per SM
    assert resident_threads(res(32), 256, 100 * 1024, 'sm_90') == 512      # sm_90 has 228 KiB
    assert resident_threads(res(32), 256, 200 * 1024, 'sm_80') == 0        # over sm_80's 163 KiB per block

def _rows(log, budget=None, arch='sm_90'):
    k = load_kernel(KDIR / 'lattice_scan.cu', 'lattice_forward', **Max.cuda_macros(torch.float32))
    name = re.search(r"entry function '(\w+)'", log)[1]
    k = type('K', (), dict(path=k.path, name=name, macros=k.macros, budget=budget))()
    return resource_rows([k], {(str(k.path), tuple(k.macros.items()), arch): log}, (arch,))

def test_a_spilling_kernel_or_one_below_its_floor_fails_the_budget():
    spill = PTXAS_LOG.split("ptxas info    : Compiling entry function 'reducer'")[0]
    row, = _rows(spill)
    assert row['problems'] == ["local memory: 5508 B spill stores, 5668 B spill loads, 304 B stack frame"]
    clean = "ptxas info    : Compiling entry function 'clean'" + PTXAS_LOG.split("entry function 'clean'")[1]
    assert _rows(clean, Budget(1024, 0, 2048, ''))[0]['problems'] == []
    row, = _rows(clean.replace('Used 18 registers', 'Used 40 registers'), Budget(1024, 0, 2048, ''))
    assert row['threads'] == 1024 and row['problems'] == ["1024 resident threads per SM at 1024-thread blocks, below its floor of 2048"]
    assert 'FAIL' in format_resource_table([row]) and 'FAIL' not in format_resource_table(_rows(clean))

@needs_compiler
def test_a_kernel_that_spills_fails_the_compile_check(tmp_path, capsys):
    "A real compile: 64 live values where launch bounds of 1024 threads leave 64 registers: ptxas spills, the check fails."
    (tmp_path / 'spills.cu').write_text(
        'extern "C" __global__ void __launch_bounds__(1024) spills(float* x, int i) {\n  float a[64], s = 0;\n'
        '  for (int k = 0; k < 64; k++) a[k] = x[k * blockDim.x + threadIdx.x];\n  a[i & 63] += 1;\n'
        '  for (int k = 0; k < 64; k++) s += a[k] * a[63 - k];\n  x[threadIdx.x] = s;\n}\n')
    k = load_kernel(tmp_path / 'spills.cu', 'spills')
    failures = check_gpu_compile([k], archs=('sm_90',), resources=True)
    out = capsys.readouterr().out
    assert len(failures) == 1 and 'local memory' in failures[0][2] and 'FAIL sm_90 resources: spills' in out

@needs_compiler
def test_a_package_kernel_declaring_a_budget_meets_it():
    """A CTC kernel (whose budget 02_ctc declares) compiles without spills and with its floor of resident threads, for
    sm_80 and sm_90. Every kernel is checked so by `seqdist-compile-check`, a step of `make test` of its own: here one,
    to prove the check passes a real kernel (the tests above prove it fails a bad one)."""
    ks = [k for k in package_kernels() if k.path.name == 'ctc.cu']
    assert ks and all(getattr(k, 'budget', None) for k in ks)
    assert check_gpu_compile(ks[:1]) == []

def test_every_package_kernel_declares_a_budget():
    "A kernel cannot join the package without a resource budget (`resource_budget` next to its instantiation)."
    ks = [k for k in package_kernels() if k.path.resolve().parent == cuda_dir().resolve()]   # not the tests' own kernels
    assert {k.path.name for k in ks} >= {'ctc.cu', 'ctc_simple.cu', 'sparse.cu', 'crf.cu', 'rnnt.cu', 'gru.cu', 'cross_entropy.cu'}
    missing = sorted({f"{k.path.name}:{k.name}" for k in ks if getattr(k, 'budget', None) is None})
    assert not missing, f"kernels without a resource_budget: {missing}"
    for k in ks:
        b = k.budget
        assert 32 <= b.block <= 1024 and b.block % 32 == 0 and 0 <= b.shared_mem <= EMULATOR_MAX_SHARED_MEM, (k, b)
        assert 0 < b.min_threads <= 2048 and b.why, (k, b)

def test_a_launch_beyond_its_budget_is_caught():
    "conftest's check, which every test runs under: a launch larger than its kernel's budget is reported."
    from seqdist.utils import semiring_sum, _sum_rows, resource_budget
    from conftest import budget_overruns
    k = _sum_rows[(torch.float64, Log)]
    b, x = k.budget, torch.randn(2, 100, dtype=torch.float64)
    try:
        resource_budget([k], block=64, shared_mem=b.shared_mem, min_threads=b.min_threads, why=b.why)
        with budget_overruns() as over: semiring_sum(x, Log, block=64)
        assert over == []
        with budget_overruns() as over: semiring_sum(x, Log, block=128)
        assert len(over) == 1 and 'semiring_sum_rows' in over[0] and 'its budget declares block 64' in over[0]
    finally: k.budget = b

def test_compile_cache_keys_on_source_headers_and_arch(tmp_path, monkeypatch):
    "A compile result is reused only for the same source, headers, arch and compiler; a changed header compiles again."
    from seqdist.compile_check import _cached_compile
    monkeypatch.setenv('SEQDIST_CACHE', str(tmp_path / 'cache'))
    inc = tmp_path / 'inc'; inc.mkdir()
    (inc / 'h.cuh').write_text('#define X 1\n')
    calls = []
    def fake(source, arch, include_dirs=(), name=''):
        calls.append((source, arch)); return True, f"log {len(calls)}"
    src = '#include "h.cuh"\n__global__ void k() {}\n'
    assert _cached_compile('nvcc-fake', fake, src, 'sm_80', [str(inc)], 'k.cu') == (True, 'log 1')
    assert _cached_compile('nvcc-fake', fake, src, 'sm_80', [str(inc)], 'k.cu') == (True, 'log 1') and len(calls) == 1
    assert _cached_compile('nvcc-fake', fake, src, 'sm_90', [str(inc)], 'k.cu') == (True, 'log 2')
    assert _cached_compile('nvcc-fake', fake, src + ' ', 'sm_80', [str(inc)], 'k.cu') == (True, 'log 3')
    (inc / 'h.cuh').write_text('#define X 2\n')
    assert _cached_compile('nvcc-fake', fake, src, 'sm_80', [str(inc)], 'k.cu') == (True, 'log 4')
