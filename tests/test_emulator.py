"""The CUDA emulator runs small kernels of our own against numpy/PyTorch, and catches the planted bugs: a missing
barrier (a wrong answer under some seeds), barrier and warp divergence (an error, not a hang), out-of-bounds
accesses (an error naming the thread and the argument)."""
import math
import numpy as np, pytest, torch
from seqdist.core import Log, Max
from seqdist.utils import load_kernel, emulator_options, KernelLaunchError, KernelCompileError
from conftest import KERNELS

def kernel(fname, name, **macros): return load_kernel(KERNELS / fname, name, **macros)

# --- correct kernels give correct answers -------------------------------------------------------------------
@pytest.mark.parametrize('seed', [0, 1, 2])
def test_block_reduction_in_shared_memory(seed):
    x = torch.randn(5, 1000)
    out = torch.empty(5)
    with emulator_options(seed=seed): kernel('block_reduce.cu', 'block_sum')((5,), (256,), (x, out, 1000))
    torch.testing.assert_close(out, x.sum(1), rtol=1e-5, atol=1e-4)

def test_missing_syncthreads_gives_a_wrong_answer_under_some_seeds():
    racy = kernel('block_reduce.cu', 'block_sum', SYNC='')
    x = torch.randn(3, 256)
    wrong = 0
    for seed in range(6):
        out = torch.empty(3)
        with emulator_options(seed=seed): racy((3,), (256,), (x, out, 256))
        wrong += not torch.allclose(out, x.sum(1), rtol=1e-5, atol=1e-4)
    assert wrong > 0

def test_warp_shuffle_reductions():
    x = torch.randn(4 * 64, dtype=torch.float64)
    out = torch.empty_like(x)
    kernel('warp_ops.cu', 'warp_sum_xor')((4,), (64,), (x, out))
    torch.testing.assert_close(out, x.view(-1, 32).sum(1).repeat_interleave(32))
    xf, outf = x.float(), torch.empty(8)
    kernel('warp_ops.cu', 'warp_sum_down')((4,), (64,), (xf, outf))
    torch.testing.assert_close(outf, xf.view(-1, 32).sum(1))

def test_warp_inclusive_scan_with_shfl_up():
    x = torch.randint(-5, 5, (128,), dtype=torch.int32)
    out = torch.empty_like(x)
    kernel('warp_ops.cu', 'warp_scan_up')((2,), (64,), (x, out))
    assert torch.equal(out, x.view(-1, 32).cumsum(1).view(-1).int())

@pytest.mark.parametrize('width', [32, 16, 4])
def test_shfl_sync_with_width(width):
    x = torch.randn(64)
    src = torch.randint(0, 64, (64,), dtype=torch.int32)
    out = torch.empty(64)
    kernel('warp_ops.cu', 'warp_broadcast')((1,), (64,), (x, src, out, width))
    lane = torch.arange(64)
    expected = x[(lane // 32) * 32 + (lane % 32 // width) * width + src.long() % width]
    assert torch.equal(out, expected)

def test_votes():
    pred = torch.randint(0, 2, (96,), dtype=torch.int32)
    pred[64:] = 1
    ballot, any_, all_ = torch.empty(96, dtype=torch.int32), torch.empty(96, dtype=torch.int32), torch.empty(96, dtype=torch.int32)
    kernel('warp_ops.cu', 'warp_votes')((1,), (96,), (pred, ballot, any_, all_))
    for w in range(3):
        p = pred[32 * w: 32 * w + 32]
        bits = int(sum(int(v) << i for i, v in enumerate(p.tolist())))
        assert (ballot[32 * w: 32 * w + 32].to(torch.int64) & 0xffffffff == bits).all()
        assert (any_[32 * w: 32 * w + 32] == int(p.any())).all() and (all_[32 * w: 32 * w + 32] == int(p.all())).all()

def test_separate_masks_in_one_warp():
    x = torch.randn(32)
    out = torch.empty(32)
    kernel('warp_ops.cu', 'half_warps')((1,), (32,), (x, out))
    lane = torch.arange(32)
    torch.testing.assert_close(out, x + x[torch.where(lane < 16, lane ^ 1, lane ^ 2)])

def lattice_reference(x, S):
    N, T, C = x.shape
    alpha = [torch.full((N, C), S.zero, dtype=x.dtype).index_fill_(1, torch.tensor([0]), S.one)]
    for t in range(T):
        a = alpha[-1]
        shifted = torch.cat([torch.full((N, 1), S.zero, dtype=x.dtype), a[:, :-1]], 1)
        alpha.append(S.mul(x[:, t], S.sum(torch.stack([a, shifted]), dim=0)))
    return torch.stack(alpha, 1)

@pytest.mark.parametrize('S', [Log, Max])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('S_states,block', [(40, 64), (200, 64)])  # one state per thread, and the looping path
def test_double_buffered_lattice_scan(S, dtype, S_states, block):
    N, T = 3, 7
    x = torch.randn(N, T, S_states, dtype=dtype)
    alpha = torch.empty(N, T + 1, S_states, dtype=dtype)
    k = kernel('lattice_scan.cu', 'lattice_forward', **S.cuda_macros(dtype))
    for seed in range(2):
        with emulator_options(seed=seed): k((N,), (block,), (x, alpha, T, S_states), shared_mem=2 * S_states * x.element_size())
        torch.testing.assert_close(alpha, lattice_reference(x, S), rtol=1e-5 if dtype == torch.float32 else 1e-12,
                                   atol=1e-6 if dtype == torch.float32 else 0)  # log-space values near 0

def test_single_buffered_lattice_scan_races():
    N, T, S_states = 2, 5, 128
    x = torch.randn(N, T, S_states, dtype=torch.float64)
    k = kernel('lattice_scan.cu', 'lattice_forward', NBUF=1, **Log.cuda_macros(torch.float64))
    wrong = 0
    for seed in range(4):
        alpha = torch.empty(N, T + 1, S_states, dtype=torch.float64)
        with emulator_options(seed=seed): k((N,), (64,), (x, alpha, T, S_states), shared_mem=S_states * 8)
        wrong += not torch.allclose(alpha, lattice_reference(x, Log))
    assert wrong > 0

def test_3d_grids_and_blocks():
    out = torch.full((2 * 3 * 2 * 4 * 2 * 3,), -1, dtype=torch.int32)
    kernel('misc.cu', 'write_indices')((2, 3, 2), (4, 2, 3), (out,))
    expected = [((bx * 4 + by) * 4 + bz) * 1000 + (tx * 4 + ty) * 4 + tz
                for bz in range(2) for by in range(3) for bx in range(2) for tz in range(3) for ty in range(2) for tx in range(4)]
    assert out.tolist() == expected

def test_static_and_dynamic_shared_memory():
    x = torch.randn(3, 50, dtype=torch.float64)
    out = torch.empty_like(x)
    kernel('misc.cu', 'reverse_rows')((3,), (32,), (x, out, 50), shared_mem=50 * 8)
    assert torch.equal(out, x.flip(1))

def test_atomics():
    x = torch.randint(0, 10, (1000,), dtype=torch.int32)
    counts, weights, mx = torch.zeros(10, dtype=torch.int32), torch.zeros(10), torch.zeros(1, dtype=torch.int32)
    kernel('misc.cu', 'histogram')((8,), (128,), (x, 1000, counts, weights, mx))
    assert torch.equal(counts, torch.bincount(x, minlength=10).int())
    assert torch.equal(weights, counts.float() * 0.5) and mx.item() == x.max().item()
    xf = torch.randn(300)
    best = torch.full((1,), -1e30)
    kernel('misc.cu', 'cas_max')((3,), (128,), (xf, 300, best))
    assert best.item() == xf.max().item()

def test_scalar_parameters_of_every_width():
    out = torch.empty(5, dtype=torch.float64)
    kernel('misc.cu', 'scalars')((1,), (1,), (out, -2**40, 2**32 - 1, 0.5, True, -7))
    assert out.tolist() == [-2**40, 2**32 - 1, 0.5, 1.0, -7]

def test_same_seed_same_bits_and_inputs_unmodified():
    x = torch.randn(4, 300)
    x0 = x.clone()
    outs = []
    for _ in range(2):
        out = torch.empty(4)
        with emulator_options(seed=3): kernel('block_reduce.cu', 'block_sum')((4,), (128,), (x, out, 300))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(x, x0)

# --- planted bugs give clear errors -------------------------------------------------------------------------
def run_bug(name, *args, block=32, grid=1, shared_mem=0, check_bounds=True):
    with emulator_options(check_bounds=check_bounds):
        kernel('bugs.cu', name)((grid,), (block,), args, shared_mem=shared_mem)

@pytest.mark.parametrize('name,args,message', [
    ('divergent_barrier', (torch.empty(32),), r'barrier divergence: thread \(\d+,0,0\) of block \(0,0,0\) waits at __syncthreads\(\) \(line 3\) but thread \(\d+,0,0\) of block \(0,0,0\) has exited'),
    ('two_barriers', (torch.empty(32),), r'barrier divergence: .* on line (7|8) but .* on line (7|8)'),
    ('early_return', (torch.randn(32), torch.empty(32), 20), r'barrier divergence: .*__syncthreads\(\) \(line 14\) but thread \((2\d|3[01]),0,0\) .* has exited'),
])
def test_barrier_divergence_is_an_error_not_a_hang(name, args, message):
    with pytest.raises(KernelLaunchError, match=message): run_bug(name, *args, shared_mem=32 * 4)

def test_warp_divergence_and_bad_shuffles_are_errors():
    with pytest.raises(KernelLaunchError, match=r'warp divergence: .* __shfl_(xor|down)_sync .* __shfl_(xor|down)_sync'):
        kernel('warp_ops.cu', 'diverged_shuffles')((1,), (32,), (torch.randn(32), torch.empty(32)))
    with pytest.raises(KernelLaunchError, match=r'__shfl_down_sync \(line \d+\): thread \((8|9|1[0-5]),0,0\) .* reads lane (1[6-9]|2[0-3]), which is not a live lane named in mask 0x0000ffff'):
        kernel('warp_ops.cu', 'shuffle_outside_mask')((1,), (32,), (torch.randn(32), torch.empty(32)))

def test_read_past_the_end_names_the_argument():
    with pytest.raises(KernelLaunchError, match=r"invalid memory access by thread \(4,0,0\) of block \(1,0,0\) .*: 0 bytes past the end of argument 'x' \(float\* x, 20 elements = 80 bytes\)"):
        run_bug('read_past_end', torch.randn(20), torch.empty(20), 20, grid=2, block=16)

def test_write_past_the_end_names_the_argument():
    with pytest.raises(KernelLaunchError, match=r"0 bytes past the end of argument 'out'"):
        run_bug('write_past_end', torch.empty(10), 10, block=32)

def test_write_before_the_start_is_found():
    out = torch.zeros(10)
    with pytest.raises(KernelLaunchError, match=r"wrote before the start of argument 'out'"):
        run_bug('write_before_start', out, 10)
    assert (out == 0).all()   # a failed launch leaves the arguments as they were

def test_dynamic_shared_memory_past_the_end():
    with pytest.raises(KernelLaunchError, match=r"dynamic shared memory by thread \(31,0,0\) .* 0 bytes past the end of the 128 bytes"):
        run_bug('shared_past_end', torch.empty(32), shared_mem=32 * 4)

def test_null_pointer_is_an_error_not_a_crash():
    with pytest.raises(KernelLaunchError, match=r"invalid memory access by thread \(\d+,0,0\) of block \(0,0,0\) at address 0x[0-9a-f]{1,2}$"):
        run_bug('null_write', None)

def test_device_assert():
    with pytest.raises(KernelLaunchError, match=r"assertion failed: x\[threadIdx.x\] >= 0"):
        kernel('bugs.cu', 'failed_assert')((1,), (8,), (torch.tensor([0, 1, 2, -1, 4, 5, 6, 7], dtype=torch.int32),))

def test_emulator_keeps_working_after_errors():
    test_block_reduction_in_shared_memory(0)

def test_log_sums_values_and_their_nan():
    """semiring.cuh's logsumexp2/3 (the largest plus log1p of the others): log(sum e^x) to rounding for every pair and
    triple of {-inf, -30, -3, 0.5, 2, 700, +inf, NaN} in every order; NaN where any term is NaN or +inf, or all are
    -inf (e^(x - m) with an infinite m), whichever position it holds: what the previous form, e^(x - m) for each term, gave."""
    import itertools
    vals = [-math.inf, -30.0, -3.0, 0.5, 2.0, 700.0, math.inf, math.nan]
    trip = np.array(list(itertools.product(vals, repeat=3)))
    a, b, c = (torch.tensor(trip[:, k]) for k in range(3))
    out2, out3 = torch.empty_like(a), torch.empty_like(a)
    kernel('semiring_sums.cu', 'log_sums')((math.ceil(len(a) / 128),), (128,), (a, b, c, out2, out3, len(a)))
    for got, cols in ((out2, trip[:, :2]), (out3, trip)):
        nan = np.isnan(cols).any(1) | np.isposinf(cols).any(1) | np.isneginf(cols).all(1)
        assert np.isnan(got.numpy()[nan]).all()
        m = cols[~nan].max(1, keepdims=True)
        want = m[:, 0] + np.log(np.exp(cols[~nan] - m).sum(1))
        np.testing.assert_allclose(got.numpy()[~nan], want, rtol=1e-15, atol=1e-15)
