"""The toolchain's modules (made by nbs/01_utils.ipynb) import only the ones below them, each imports on its own, and
seqdist.utils names everything they define, as it did when it was one module."""
import ast, pathlib, subprocess, sys, pytest
import seqdist.utils as utils

ROOT = pathlib.Path(__file__).resolve().parent.parent
ORDER = ['core', 'memory', 'checks', 'emulator', 'kernel', 'compile_check', 'utils', 'timing', 'ops']   # each imports only earlier ones
TOOLCHAIN = ORDER[1:ORDER.index('utils')]          # the modules utils was split into

def seqdist_imports(module):
    "The seqdist modules that `module` imports anywhere in its source (in functions too)."
    out = set()
    for n in ast.walk(ast.parse((ROOT / 'seqdist' / f'{module}.py').read_text())):
        if isinstance(n, ast.ImportFrom) and n.level: out.add((n.module or '').split('.')[0])
        elif isinstance(n, ast.ImportFrom) and (n.module or '').startswith('seqdist.'): out.add(n.module.split('.')[1])
        elif isinstance(n, ast.Import): out |= {a.name.split('.')[1] for a in n.names if a.name.startswith('seqdist.')}
    return out - {''}

@pytest.mark.parametrize('module', ORDER)
def test_a_module_imports_only_earlier_ones(module):
    later = seqdist_imports(module) & set(ORDER[ORDER.index(module):])
    assert not later, f"seqdist.{module} imports {sorted(later)}, which come after it in {ORDER}"

@pytest.mark.parametrize('module', ORDER[1:])
def test_a_module_imports_on_its_own(module):
    r = subprocess.run([sys.executable, '-c', f'import seqdist.{module}'], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]

def test_utils_names_everything_the_toolchain_defines():
    import importlib
    for module in TOOLCHAIN:
        m = importlib.import_module(f'seqdist.{module}')
        for name in m.__all__:
            assert getattr(utils, name, None) is getattr(m, name) and name in utils.__all__, (module, name)

# seqdist.utils.__all__ before the toolchain had modules of its own (seqdist 0.0.3's names among them)
NAMES = """LARGE_POOL MAX_BLOCK_DIMS MAX_THREADS_PER_BLOCK MAX_GRID_DIMS EMULATOR_MAX_SHARED_MEM KERNELS Resources GPU_LIMITS
Budget to_np zero_grad float64 compare_fwd_bwd timed benchmark_fwd_bwd report release_large_buffers empty_large
tensor_cached on_host require check_labels to_device cuda_dir find_source Param
kernel_params KernelLaunchError KernelCompileError count_launches Kernel KernelModule load_kernel load_cupy_func
load_cupy_module emulator_options rewrite_dynamic_shared emulator_source emulator_library GuardedCopy asan_environment
run_under_asan semiring_sum nvrtc_library compile_with_nvrtc compile_with_nvcc parse_ptxas_log resident_threads
resource_budget resource_rows format_resource_table gpu_compiler package_kernels check_gpu_compile compile_check_cli
selfcheck_cli""".split()

def test_every_name_of_utils_still_imports_from_it():
    namespace = {}
    exec('from seqdist.utils import *', namespace)
    assert not [n for n in NAMES if n not in namespace]
    assert utils.MAX_SHARED_MEM_PER_BLOCK == utils.EMULATOR_MAX_SHARED_MEM == min(l['smem_block'] for l in utils.GPU_LIMITS.values())

FAMILIES = sorted(p.stem for p in (ROOT / 'seqdist').glob('*.py') if p.stem not in ORDER + ['bench', '__init__', '_modidx', '_nbdev'])

@pytest.mark.parametrize('module', FAMILIES + ['bench'])
def test_no_module_imports_a_family_s_private_names(module):
    """A helper that two families share moves down to the toolchain (or core) under a public name: no module imports
    another family's private `_names`, and no family imports bench."""
    private = []
    for n in ast.walk(ast.parse((ROOT / 'seqdist' / f'{module}.py').read_text())):
        if not isinstance(n, ast.ImportFrom) or not n.module: continue
        source = n.module.split('.')[-1] if n.level or n.module.startswith('seqdist.') else None
        if source in FAMILIES and source != module:
            private += [f"{source}.{a.name}" for a in n.names if a.name.startswith('_')]
    assert not private, f"seqdist.{module} imports {private}"
    assert module == 'bench' or not {'bench', 'benchmarks'} & seqdist_imports(module)

BENCHMARKS = sorted(p.stem for p in (ROOT / 'seqdist' / 'benchmarks').glob('*.py') if p.stem != '__init__')

def test_each_family_with_a_benchmark_has_a_module_of_them():
    "The benchmarks live beside the families (seqdist.benchmarks.<family>), each family's in a module of its own."
    assert {'rnnt', 'tdt', 'gru', 'joint', 'cross_entropy', 'crf', 'koi_decode'} <= set(BENCHMARKS)
    for family in BENCHMARKS:
        assert (ROOT / 'seqdist' / f'{family}.py').exists(), family
        source = (ROOT / 'seqdist' / f'{family}.py').read_text()
        assert 'def bench_' not in source and '_SHAPES = ' not in source, f"seqdist.{family} still holds a benchmark"

@pytest.mark.parametrize('module', BENCHMARKS)
def test_a_benchmark_uses_only_public_names_and_no_runner(module):
    "A benchmark module imports its family's public names and the timing helpers, never seqdist.bench (which runs it)."
    tree = ast.parse((ROOT / 'seqdist' / 'benchmarks' / f'{module}.py').read_text())
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and (n.level or n.module.startswith('seqdist')):
            source = n.module.split('.')[-1]
            assert source != 'bench', f"seqdist.benchmarks.{module} imports seqdist.bench"
            if source in FAMILIES: assert not [a.name for a in n.names if a.name.startswith('_')], (module, source)
    r = subprocess.run([sys.executable, '-c', f'import seqdist.benchmarks.{module}'], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
