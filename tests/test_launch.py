"""The launch glue shared by the CuPy and emulator paths: every bad launch gets a clear error naming the kernel and
the argument, before anything runs."""
import pytest, torch
from seqdist.core import Log
from seqdist.utils import load_kernel, load_cupy_func, load_cupy_module, kernel_params, semiring_sum, KERNELS, find_source
from conftest import KERNELS as KDIR

reduce = load_kernel(KDIR / 'block_reduce.cu', 'block_sum')
lattice = load_kernel(KDIR / 'lattice_scan.cu', 'lattice_forward', **Log.cuda_macros(torch.float64))
scalars = load_kernel(KDIR / 'misc.cu', 'scalars')
x, out = torch.randn(2, 8), torch.empty(2)

BAD_LAUNCHES = [
    (reduce, (2,), (32,), (x, out), {}, TypeError, r"kernel block_sum takes 3 arguments \(float\* x, float\* out, int cols\), got 2"),
    (reduce, (2,), (32,), (x.double(), out, 8), {}, TypeError, r"argument 'x' \(float\* x\) takes a torch.float32 tensor, got torch.float64"),
    (reduce, (2,), (32,), (x.t(), out, 8), {}, ValueError, r"argument 'x' .* non-contiguous tensor: pass `.contiguous\(\)`"),
    (reduce, (2,), (32,), (x, out, 8.0), {}, TypeError, r"argument 'cols' \(int cols\) takes an integer, got 8.0"),
    (reduce, (2,), (32,), (x, out, 2**31), {}, ValueError, r"argument 'cols' \(int cols\): 2147483648 does not fit in a C int"),
    (reduce, (2,), (32,), ([1.0], out, 8), {}, TypeError, r"argument 'x' \(float\* x\) takes a tensor or None, got list"),
    (reduce, (2,), (32,), (x, out.to('meta'), 8), {}, ValueError, r"argument 'out' .* is on meta but the first tensor argument is on cpu"),
    (reduce, (2,), (32,), (x, out, torch.ones(2)), {}, TypeError, r"argument 'cols' .* takes a scalar, got a tensor of shape \(2,\)"),
    (reduce, (2,), (2048,), (x, out, 8), {}, ValueError, r"kernel block_sum: block=\(2048, 1, 1\) is too large"),
    (reduce, (2,), (32, 32, 2), (x, out, 8), {}, ValueError, r"block=\(32, 32, 2\) is too large: at most 1024 threads"),
    (reduce, (0,), (32,), (x, out, 8), {}, ValueError, r"kernel block_sum: grid must be 1 to 3 positive ints, got \(0,\)"),
    (reduce, (1, 70000), (32,), (x, out, 8), {}, ValueError, r"grid=\(1, 70000, 1\) exceeds the limits"),
    (reduce, 2.5, (32,), (x, out, 8), {}, ValueError, r"grid must be 1 to 3 positive ints, got 2.5"),
    (reduce, (2,), (32,), (x, out, 8), {'shared_mem': -1}, ValueError, r"shared_mem must be a non-negative int"),
    (reduce, (2,), (32,), (x, out, 8), {'shared_mem': 200 * 1024}, ValueError, r"shared_mem=204800 bytes exceeds the 166912 bytes a block may use"),
    (lattice, (1,), (32,), (x.double(), torch.empty(3, 8), 2, 8), {}, TypeError, r"argument 'alpha' \(double\* alpha\) takes a torch.float64 tensor, got torch.float32"),
    (scalars, (1,), (1,), (out.double(), 1, -1, 0.5, True, 1), {}, ValueError, r"argument 'b' \(unsigned int b\): -1 does not fit"),
    (scalars, (1,), (1,), (out.double(), 1, 1, True, True, 1), {}, TypeError, r"argument 'c' \(float c\) takes a real number, got True"),
]

@pytest.mark.parametrize('k,grid,block,args,kw,error,message', BAD_LAUNCHES)
def test_bad_launch_is_a_clear_error(k, grid, block, args, kw, error, message):
    with pytest.raises(error, match=message): k(grid, block, args, **kw)

def test_unknown_kernel_and_unsupported_parameter_types():
    with pytest.raises(ValueError, match=r"no `__global__ void nope\(...\)` in the CUDA source"):
        load_kernel(KDIR / 'misc.cu', 'nope').params
    with pytest.raises(ValueError, match=r"unsupported parameter type 'float3'"):
        kernel_params('__global__ void k(float3 x) {}', 'k')
    with pytest.raises(FileNotFoundError, match=r"CUDA source 'missing.cu' not found"):
        load_kernel('missing.cu', 'k')

def test_signature_reading_resolves_macros_and_qualifiers():
    src = 'extern "C" __global__ void f(const FLOAT* __restrict__ a, volatile long *b, unsigned n, long long m /* c */) {}'
    assert [repr(p) for p in kernel_params(src, 'f', {'FLOAT': 'double'})] == \
        ['double* a', 'long* b', 'unsigned int n', 'long long m']

def test_legacy_loaders_and_the_registry():
    k = load_cupy_func('cuda/semiring_reduce.cu', 'semiring_sum_rows', **Log.cuda_macros(torch.float32))
    assert k.path == find_source('semiring_reduce.cu')
    m = load_cupy_module('semiring_reduce.cu', **Log.cuda_macros(torch.float64)).get_function('semiring_sum_rows')
    assert (str(m.path), 'semiring_sum_rows', tuple(m.macros.items())) in KERNELS
    assert KERNELS[(str(m.path), 'semiring_sum_rows', tuple(m.macros.items()))] is m and m.budget and k.budget   # budgets carry over
    x = torch.randn(3, 100, dtype=torch.float64)
    y = torch.empty(3, dtype=torch.float64)
    m((3,), (64,), (x, y, 3, 100), shared_mem=2 * 8)
    torch.testing.assert_close(y, torch.logsumexp(x, 1))

def test_launch_by_parameter_name():
    "`kernel(grid, block, name=value, ...)` is the launch of the positional tuple; a missing or unknown name is a TypeError."
    by_tuple, by_name = torch.empty(2), torch.empty(2)
    reduce((2,), (32,), (x, by_tuple, 8))
    reduce((2,), (32,), cols=8, out=by_name, x=x)                   # in any order
    assert torch.equal(by_tuple, by_name)
    torch.testing.assert_close(by_name, x.sum(1))
    with pytest.raises(TypeError, match=r"kernel block_sum: missing argument 'cols' \(int cols\)"):
        reduce((2,), (32,), x=x, out=by_name)
    with pytest.raises(TypeError, match=r"kernel block_sum has no parameter 'rows' \(its parameters: float\* x, float\* out, int cols\)"):
        reduce((2,), (32,), x=x, out=by_name, cols=8, rows=2)
    with pytest.raises(TypeError, match=r"kernel block_sum has no parameter 'rows'"):
        reduce((2,), (32,), x=x, out=by_name, rows=8)               # as many names as parameters, one of them wrong
    with pytest.raises(TypeError, match=r"kernel block_sum: pass its arguments as a tuple or by name, not both"):
        reduce((2,), (32,), (x, by_name), cols=8)
    with pytest.raises(TypeError, match=r"kernel block_sum: missing argument 'x'"):
        reduce((2,), (32,))
    with pytest.raises(TypeError, match=r"argument 'x' \(float\* x\) takes a torch.float32 tensor, got torch.float64"):
        reduce((2,), (32,), x=x.double(), out=by_name, cols=8)      # named arguments are checked as positional ones

def test_cuda_tensors_need_cupy_or_a_gpu():
    if torch.cuda.is_available(): pytest.skip("a GPU is present: the CUDA path is exercised by the notebooks' cuda cells")
    # Without a GPU, torch refuses CUDA tensors before our code runs; the launcher itself is covered by the emulator.
    with pytest.raises((RuntimeError, AssertionError)): torch.empty(1, device='cuda')

@pytest.mark.parametrize('shape', [(1, 1), (5, 31), (3, 1823), (2, 4096)])
@pytest.mark.parametrize('block', [32, 96, 256])
def test_semiring_sum_irregular_shapes(shape, block):
    x = torch.randn(*shape, dtype=torch.float64) * 5
    torch.testing.assert_close(semiring_sum(x, Log, block=block), torch.logsumexp(x, 1), rtol=1e-12, atol=0)

@pytest.mark.parametrize('bad,error,message', [
    (dict(x=torch.randn(3)), ValueError, r"x must be a 2D tensor"),
    (dict(x=torch.randn(3, 3, dtype=torch.float16)), TypeError, r"x must be float32 or float64, got torch.float16"),
    (dict(x=torch.randn(3, 3), block=48), ValueError, r"block must be a multiple of 32"),
])
def test_semiring_sum_bad_input(bad, error, message):
    with pytest.raises(error, match=message): semiring_sum(**bad)

class FakeCuPy:
    """The parts of CuPy that the CUDA launch path uses, as CuPy 14 defines them (RawModule(code, options).get_function
    gives a RawKernel, called as kernel(grid, block, args, shared_mem=, stream=) where stream is any object with a
    raw `ptr`), recording what the launch path asks of them: the GPU path's glue, checked without a GPU."""
    def __init__(self):
        self.modules, self.launches, self.dynamic_set, self.devices = 0, [], [], []
        fake = self
        class Device:
            def __init__(self, idx): self.idx = idx
            def __enter__(self): fake.devices.append(self.idx)
            def __exit__(self, *exc): pass
        class RawKernel:
            max_threads_per_block, shared_size_bytes = 1024, 0
            def __setattr__(self, name, value):
                if name == 'max_dynamic_shared_size_bytes': fake.dynamic_set.append(value)
                object.__setattr__(self, name, value)
            def __call__(self, grid, block, args, shared_mem=0, stream=None):
                fake.launches.append((grid, block, args, shared_mem, stream.ptr))
        class RawModule:
            def __init__(self, code, options):
                assert '#define FLOAT double' in code and options[0] == '--std=c++17'
                fake.modules += 1
            def get_function(self, name): return RawKernel()
        class runtime:
            @staticmethod
            def getDeviceProperties(idx): return {'sharedMemPerBlockOptin': 227 * 1024}
        class cuda: pass
        cuda.Device, cuda.runtime = Device, runtime
        self.RawModule, self.cuda = RawModule, cuda

def test_cupy_launch_path_with_a_fake_cupy(monkeypatch):
    import seqdist.kernel as U
    fake = FakeCuPy()
    monkeypatch.setattr(U, '_import_cupy', lambda: fake)
    monkeypatch.setattr(U, '_current_stream', lambda idx: U._RawStream(1234 + idx))
    k = load_kernel(KDIR / 'lattice_scan.cu', 'lattice_forward', **Log.cuda_macros(torch.float64))
    scores, alpha = torch.randn(3, 8, dtype=torch.float64), torch.empty(4, 8, dtype=torch.float64)
    values = U._pointers(U._marshal(k, (scores, alpha, 3, 8), scores.device))
    gpu = torch.device('cuda', 1)
    for shared in (0, 64 * 1024, 64 * 1024, 100 * 1024):
        U._launch_cupy(k, gpu, (1, 1, 1), (32, 1, 1), values, shared)
    assert fake.modules == 1 and fake.devices == [1] * 4                 # compiled once, launched on the tensors' device
    assert fake.dynamic_set == [64 * 1024, 100 * 1024]                   # the opt-in raised only when it must grow
    grid, block, args, shared, stream = fake.launches[0]
    assert stream == 1235 and args[:2] == (scores.data_ptr(), alpha.data_ptr()) and args[2:] == (3, 8)
    with pytest.raises(ValueError, match="exceeds the 232448 bytes"):
        U._launch_cupy(k, gpu, (1, 1, 1), (32, 1, 1), values, 228 * 1024)
    with pytest.raises(ValueError, match="more threads than the 1024"):
        U._launch_cupy(k, gpu, (1, 1, 1), (64, 32, 1), values, 0)

def test_the_generated_marshaller_gives_what_the_checked_one_gives():
    """`_fast_marshal`'s function (generated once per kernel, run before every launch) gives `_marshal_checked`'s
    values for well-formed arguments, by position and by name, and on a GPU (here `pointers_on='cpu'`) their
    addresses as CuPy takes them (`_pointers`); anything else it leaves to the checked path (None), which names it."""
    import seqdist.kernel as U
    x, out = torch.randn(2, 8), torch.empty(2)
    k = lattice
    scores, alpha = torch.randn(3, 8, dtype=torch.float64), torch.empty(4, 8, dtype=torch.float64)
    fast = U._fast_marshal(k)
    for got in (fast(scores, alpha, 3, 8), fast(**dict(zip(k.param_names, (scores, alpha, 3, 8))))):
        device, values = got
        want = U._marshal_checked(k, (scores, alpha, 3, 8), scores.device)
        assert device == scores.device and len(values) == len(want)
        assert all(a is b if isinstance(b, torch.Tensor) else (type(a) is type(b) and a == b) for a, b in zip(values, want))
    device, pointers = U._fast_marshal(k, pointers_on='cpu')(scores, None, 3, 8)
    assert pointers == U._pointers(U._marshal_checked(k, (scores, None, 3, 8), scores.device))
    assert pointers[0] == scores.data_ptr() and pointers[1] == 0 and type(pointers[2]) is type(want[2])
    for bad in ((scores.float(), alpha, 3, 8), (scores.t(), alpha, 3, 8), (scores, alpha.to('meta'), 3, 8),
                (scores, alpha, 2**31, 8), (scores, alpha, 3.0, 8), (scores, alpha, True, 8), (scores, [1.0], 3, 8),
                (torch.nn.Parameter(scores), alpha, 3, 8)):
        assert fast(*bad) is None                                     # the checked path decides (and names what is wrong)
    p = torch.nn.Parameter(scores.clone())                            # (a Parameter is well formed: checked, accepted)
    assert U._marshal(k, (p, alpha, 3, 8), p.device)[0] is p

def test_a_kernel_whose_parameter_is_a_python_keyword_launches_by_position_and_name(tmp_path):
    import seqdist.kernel as U
    src = tmp_path / 'kw.cu'
    src.write_text('extern "C" __global__ void twice(const float* in, float* out, int n) {\n'
                   '    int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) out[i] = 2 * in[i]; }\n')
    k = load_kernel(src, 'twice')
    assert k.fast_marshal is None
    x, out = torch.arange(5.0), torch.empty(5)
    k((1,), (32,), (x, out, 5))
    assert torch.equal(out, 2 * x)
    k((1,), (32,), **{'in': x + 1, 'out': out, 'n': 5})
    assert torch.equal(out, 2 * x + 2)
