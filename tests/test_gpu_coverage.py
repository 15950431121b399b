"""On every machine (CPU too): every op that seqdist registers with torch.library, and every public entry point, has
GPU tests in tests/test_gpu.py, so that a new op cannot be added without one."""
import pathlib, re, torch
from seqdist.utils import package_kernels

def _gpu_tests():
    import importlib.util
    spec = importlib.util.spec_from_file_location('gpu_tests', pathlib.Path(__file__).parent / 'test_gpu.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

def test_every_registered_op_has_a_gpu_test_family():
    package_kernels()                                              # imports every module: every op registers
    ops = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith('seqdist::')}
    g = _gpu_tests()
    assert ops, "no seqdist ops registered?"
    missing = sorted(ops - set(g.OP_FAMILY))
    assert not missing, f"ops without a GPU test family in tests/test_gpu.py's OP_FAMILY: {missing}"
    assert set(g.OP_FAMILY.values()) <= set(g.FAMILIES), "OP_FAMILY names a family that FAMILIES does not test"
    for fam in g.FAMILIES:                                         # and every family is in every per-concern test
        for t in ('test_gpu_agrees_with_cpu', 'test_gpu_bitwise_repeatable', 'test_gpu_no_host_sync',
                  'test_gpu_cuda_graph_replay', 'test_gpu_half_precision_inputs', 'test_gpu_peak_memory_within_bound'):
            params = [m.args for m in getattr(g, t).pytestmark if m.name == 'parametrize' and m.args[0] == 'family']
            names = [getattr(p, 'values', (p,))[0] for p in params[0][1]] if params else []
            assert fam in names, f"{t} does not run family {fam}"

def test_every_public_entry_point_is_called_by_a_gpu_test():
    g = _gpu_tests()
    src = (pathlib.Path(__file__).parent / 'test_gpu.py').read_text()
    for name in g.PUBLIC:
        call = name.split('.')[-1]
        assert re.search(rf"\b{re.escape(call)}\(", src), f"{name} is not called in tests/test_gpu.py"

def test_gpu_benchmark_covers_every_family_with_a_cuda_kernel():
    "`seqdist-bench --device cuda` (make gpu-bench) has a row group for every family whose op runs a CUDA kernel."
    from seqdist.bench import _families
    for quick in (True, False):
        names = [name for name, _ in _families(quick, 'cuda', gpu=True)]
        assert set(names) >= {'ctc', 'forced_align', 'ctc_crf', 'rnnt', 'gru', 'cross_entropy'}, (quick, names)
