"""CTC: three paths (reference, numba, CUDA source in the emulator) agree; they equal brute force and PyTorch;
k2's delay penalty equals brute force of its definition; edge cases, bad inputs, torch.compile, low precision."""
import math, random, subprocess, sys, pytest, torch
import torch.nn.functional as F
import seqdist.ctc as ctc
from seqdist.core import Log, Max
from seqdist.ctc import (ctc_loss, CTCLoss, ctc_op, posteriors, forced_align, viterbi_alignments,
                         soft_alignments, logz_brute_force, interleave_blanks, loss_basic, loss_py, loss_cupy,
                         loss_direct_cupy, loss_pytorch, generate_sample_inputs, logz_reference, delay_state_offsets)
from seqdist.utils import emulator_options
from seqdist.ops import launch_limits

def compute(lp, targets, il, tl, use_max=False, posteriors_of='labels', backend='auto', blank=0, delay=0.0):
    "logZ and minus the posteriors of the labels or states (posteriors_of): the op's forward alone, no autograd."
    return ctc_op.compute(lp, targets, il, tl, blank, use_max, posteriors_of, False, False, False, delay, backend=backend)

def random_case(rng, dtype=torch.float64, max_T=30, max_N=4, max_C=8, device='cpu'):
    T, N, C = rng.randint(1, max_T), rng.randint(1, max_N), rng.randint(2, max_C)
    blank = rng.choice([0, C - 1, rng.randrange(C)])
    S = rng.randint(0, max(0, T // 2) + 1)
    labels = [c for c in range(C) if c != blank]
    targets = torch.tensor([[rng.choice(labels) for _ in range(S)] for _ in range(N)], dtype=torch.long).view(N, S)
    for n in range(N):                                   # repeats, and sometimes an infeasible target
        if S >= 2 and rng.random() < 0.5: targets[n, 1] = targets[n, 0]
    tl = torch.tensor([rng.randint(0, S) for _ in range(N)])
    il = torch.tensor([rng.randint(0, T) for _ in range(N)]) if rng.random() < 0.2 else torch.tensor([rng.randint(1, T) for _ in range(N)])
    il[rng.randrange(N)] = T
    scale = rng.choice([1.0, 3.0, 10.0])
    lp = (torch.randn(T, N, C, dtype=torch.float64) * scale).log_softmax(2).to(dtype)
    garbage = torch.randint(-5, C + 5, targets.shape)    # padding past target_lengths holds garbage
    pad = torch.arange(S)[None] >= tl[:, None]
    targets = torch.where(pad, garbage, targets)
    return lp, targets, il, tl, blank

def torch_loss_and_grad(lp, targets, il, tl, blank, reduction, zero_infinity):
    lp = lp.detach().requires_grad_()
    clean = torch.where(torch.arange(targets.shape[1])[None] < tl[:, None], targets, 1 if blank != 1 else 0)
    loss = F.ctc_loss(lp, clean, il, tl, blank, reduction, zero_infinity)
    return loss.detach(), torch.autograd.grad(loss.sum(), lp)[0]

def our_loss_and_grad(lp, targets, il, tl, blank, reduction, zero_infinity, backend='auto', delay_penalty=0.0):
    lp = lp.detach().requires_grad_()
    loss = ctc_loss(lp, targets, il, tl, blank, reduction, zero_infinity, delay_penalty, backend=backend)
    return loss.detach(), torch.autograd.grad(loss.sum(), lp)[0]

def assert_same(a, b, rtol, atol=0.0):
    assert torch.equal(torch.isnan(a), torch.isnan(b)), "NaN pattern differs"
    assert torch.equal(torch.isinf(a), torch.isinf(b)), "inf pattern differs"
    fin = torch.isfinite(a)
    torch.testing.assert_close(a[fin], b[fin].to(a.dtype), rtol=rtol, atol=atol)

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_agrees_with_pytorch_on_randomised_cases(dtype):
    "At least 200 cases per dtype: variable lengths, repeats, garbage padding, any blank, every reduction, zero_infinity."
    rng = random.Random(0 if dtype == torch.float64 else 1)
    for case in range(210):
        lp, targets, il, tl, blank = random_case(rng, dtype)
        reduction, zero_inf = rng.choice(['none', 'sum', 'mean']), rng.random() < 0.5
        ours = our_loss_and_grad(lp, targets, il, tl, blank, reduction, zero_inf)
        theirs = torch_loss_and_grad(lp, targets, il, tl, blank, reduction, zero_inf)
        if dtype == torch.float64:
            assert_same(ours[0], theirs[0], rtol=1e-10); assert_same(ours[1], theirs[1], rtol=1e-10, atol=1e-12)
        else:  # ours (float64 inside) is within 1e-6 of the float64 truth; it differs from PyTorch's float32 result by no
               # more than PyTorch's own float32 error (up to ~1e-4 on these gradients) plus 2e-6
            truth = torch_loss_and_grad(lp.double(), targets, il, tl, blank, reduction, zero_inf)
            assert_same(ours[0], truth[0], rtol=1e-6, atol=1e-6); assert_same(ours[1], truth[1], rtol=0, atol=1e-6)
            for o, t, tr in zip(ours, theirs, truth):
                fin = torch.isfinite(o) & torch.isfinite(t)
                assert ((o - t).abs()[fin].double() <= (t.double() - tr).abs()[fin] + 2e-6 + 1e-6 * tr.abs()[fin]).all()

def test_float32_is_as_accurate_as_float64_allows():
    rng = random.Random(2)
    for _ in range(20):
        lp, targets, il, tl, blank = random_case(rng, torch.float64)
        l64, g64 = our_loss_and_grad(lp, targets, il, tl, blank, 'sum', True)
        l32, g32 = our_loss_and_grad(lp.float(), targets, il, tl, blank, 'sum', True)
        torch.testing.assert_close(l32.double(), l64, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g32.double(), g64, rtol=0, atol=1e-6)

@pytest.mark.parametrize('S', [Log, Max])
def test_brute_force(S):
    torch.manual_seed(0)
    T, C = 5, 3
    for target in ([1], [1, 2], [2, 2], [], [1, 2, 1], [1, 1, 1], [2, 1, 2]):
        lp = torch.randn(T, 1, C, dtype=torch.float64).log_softmax(2)
        tg = torch.tensor([target + [0] * (3 - len(target))])
        for il in (T, 4):
            truth = logz_brute_force(lp[:il, 0], target, 0, S)
            for backend in ('reference', 'cpu', 'cuda'):
                logz, _ = compute(lp, tg, torch.tensor([il]), torch.tensor([len(target)]), S is Max, 'none', backend)
                if truth == -math.inf: assert logz.item() == -math.inf, (backend, target)
                else: torch.testing.assert_close(logz[0], truth, rtol=1e-12, atol=0)

def test_gradcheck_through_log_softmax():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 5, dtype=torch.float64, requires_grad=True)
    targets, il, tl = torch.tensor([[1, 2, 2], [3, 4, 0], [1, 0, 0]]), torch.tensor([8, 7, 5]), torch.tensor([3, 2, 1])
    for backend in ('cpu', 'reference', 'cuda'):
        assert torch.autograd.gradcheck(lambda x: ctc_loss(x.log_softmax(2), targets, il, tl, backend=backend), (x,))

def test_gradcheck_of_exact_logz():
    "With torch_grad=False the gradient is the exact derivative of logZ: the posteriors."
    torch.manual_seed(0)
    lp = torch.randn(7, 2, 4, dtype=torch.float64, requires_grad=True)
    targets, il, tl = torch.tensor([[1, 2, 3], [2, 2, 0]]), torch.tensor([7, 6]), torch.tensor([3, 2])
    f = lambda lp: ctc_op(lp, targets, il, tl, 0, False, 'labels', False, False, False, 0.0, backend='cpu')[0]
    assert torch.autograd.gradcheck(f, (lp,))

@pytest.mark.parametrize('S', [Log, Max])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('max_threads', [1024, 32])    # 32 threads for up to 61 states: the looping path
@pytest.mark.parametrize('by_state', [False, True])
def test_cuda_source_in_the_emulator_equals_the_reference(S, dtype, max_threads, by_state):
    torch.manual_seed(1)
    T, N, C = 14, 3, 6
    lp = torch.randn(T, N, C, dtype=torch.float64).log_softmax(2).to(dtype)
    targets = torch.randint(1, C, (N, 30)); targets[0, 5] = targets[0, 4]
    il, tl = torch.tensor([14, 9, 0]), torch.tensor([6, 30 if by_state else 4, 0])
    il[1] = 14 if by_state else 9
    tl[1] = 6
    posteriors_of = 'states' if by_state else 'labels'
    ref = compute(lp, targets, il, tl, S is Max, posteriors_of, 'reference')
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for seed in (0, 1):
        with emulator_options(seed=seed), launch_limits(max_threads=max_threads):
            out = compute(lp, targets, il, tl, S is Max, posteriors_of, 'cuda')
        torch.testing.assert_close(out[0], ref[0], **tol); torch.testing.assert_close(out[1], ref[1], **tol)
    cpu = compute(lp, targets, il, tl, S is Max, posteriors_of, 'cpu')
    torch.testing.assert_close(cpu[0], ref[0], **tol); torch.testing.assert_close(cpu[1], ref[1], **tol)

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_edge_cases(backend):
    lp = torch.randn(6, 3, 4, dtype=torch.float64).log_softmax(2)
    # empty targets: only blanks; T = 1 with one label; one-sequence batch
    assert torch.allclose(ctc_loss(lp, torch.zeros(3, 0, dtype=torch.long), [6, 6, 6], [0, 0, 0], reduction='none', backend=backend),
                          -lp[:, :, 0].sum(0))
    assert torch.allclose(ctc_loss(lp[:1, :1], torch.tensor([[2]]), [1], [1], reduction='none', backend=backend), -lp[0, 0, 2])
    assert torch.allclose(ctc_loss(lp[:, :1], torch.tensor([[1, 1]]), [6], [2], backend=backend),
                          F.ctc_loss(lp[:, :1], torch.tensor([[1, 1]]), [6], [2]))
    # a repeated label needs a blank between: 2 frames cannot emit "1 1"
    assert ctc_loss(lp[:2, :1], torch.tensor([[1, 1]]), [2], [2], reduction='none', backend=backend).item() == math.inf

def test_input_forms_and_non_contiguous_inputs_left_unmodified():
    torch.manual_seed(0)
    lp = torch.randn(3, 9, 5, dtype=torch.float64).log_softmax(2).transpose(0, 1)   # (T=9, N=3, C=5), a view
    assert not lp.is_contiguous()
    padded = torch.tensor([[1, 2, 3, 9], [4, 4, 0, 0], [2, 0, 0, 0]])[:, [0, 1, 2, 3]]
    tl = torch.tensor([3, 2, 1])
    before = (lp.clone(), padded.clone())
    ref = F.ctc_loss(lp, padded.clamp(max=4), torch.tensor([9, 9, 9]), tl, reduction='none')
    forms = [(padded, [9, 9, 9], tl), (torch.tensor([1, 2, 3, 4, 4, 2]), (9, 9, 9), (3, 2, 1)),
             (padded.int(), torch.tensor([9, 9, 9], dtype=torch.int32), tl.int()), (padded.T.contiguous().T, torch.tensor([9, 9, 9]), tl)]
    for targets, il, tl_ in forms:
        assert torch.allclose(ctc_loss(lp, targets, il, tl_, reduction='none'), ref)
    assert torch.equal(lp, before[0]) and torch.equal(padded, before[1])
    # unbatched (T, C) with int lengths
    assert torch.allclose(ctc_loss(lp[:, 0], torch.tensor([1, 2, 3]), 9, 3, reduction='none'), ref[0])

def test_peaked_and_long_inputs_stay_exact():
    torch.manual_seed(0)
    T, N, C = 60, 4, 6
    lp = (torch.randn(T, N, C, dtype=torch.float64) * 1e3)
    lp[:, :, 2] = -1e4                                      # log-probs down to -1e4
    lp = lp.log_softmax(2)
    targets = torch.tensor([[1, 2, 3], [2, 2, 4], [5, 1, 2], [3, 3, 3]])
    il, tl = torch.tensor([60, 50, 60, 40]), torch.tensor([3, 3, 2, 3])
    for zi in (False, True):
        ours, theirs = our_loss_and_grad(lp, targets, il, tl, 0, 'none', zi), torch_loss_and_grad(lp, targets, il, tl, 0, 'none', zi)
        assert_same(ours[0], theirs[0], rtol=1e-10)
        assert_same(ours[1], theirs[1], rtol=1e-9, atol=1e-9)
    T, N, C, L = 10_000, 2, 5, 1500                          # long sequences
    lp = torch.randn(T, N, C, dtype=torch.float64).log_softmax(2)
    targets = torch.randint(1, C, (N, L))
    ours = our_loss_and_grad(lp, targets, [T, T - 7], [L, L - 3], 0, 'none', False)
    theirs = torch_loss_and_grad(lp, targets, torch.tensor([T, T - 7]), torch.tensor([L, L - 3]), 0, 'none', False)
    assert_same(ours[0], theirs[0], rtol=1e-10)
    assert_same(ours[1], theirs[1], rtol=1e-8, atol=1e-10)

def test_an_emission_that_underflows_sends_the_cpu_kernel_to_log_space():
    "A label needed by every path, 800 below the others in every frame: exp underflows to 0 (not below _TINY): log space."
    T, C = 6, 4
    x = torch.zeros(T, 1, C, dtype=torch.float64); x[:, :, 2] = -800
    lp = x.log_softmax(2)
    tg, il, tl = torch.tensor([[1, 2]]), torch.tensor([T]), torch.tensor([2])
    for backend in ('cpu', 'cuda', 'reference'):
        ours = our_loss_and_grad(lp, tg, il, tl, 0, 'sum', False, backend)
        theirs = torch_loss_and_grad(lp, tg, il, tl, 0, 'sum', False)
        assert_same(ours[0], theirs[0], rtol=1e-12); assert_same(ours[1], theirs[1], rtol=1e-9, atol=1e-12)

def test_posteriors_and_alignments():
    torch.manual_seed(0)
    logits = torch.randn(20, 3, 6, dtype=torch.float64)
    targets, il, tl = torch.tensor([[1, 2, 2, 3], [4, 5, 0, 0], [1, 0, 0, 0]]), torch.tensor([20, 15, 20]), torch.tensor([4, 2, 1])
    soft = soft_alignments(logits, targets, il, tl, beta=1.0)                       # (T, N, 9)
    valid = torch.arange(20)[:, None] < il[None]
    torch.testing.assert_close(soft.sum(-1), valid.double())                       # one distribution per valid frame
    hard = viterbi_alignments(logits, targets, il, tl)
    assert set(hard.unique().tolist()) <= {0.0, 1.0} and torch.equal(hard.sum(-1), valid.double())
    assert torch.equal((soft_alignments(logits, targets, il, tl, beta=1e3) > 0.5).double(), hard)
    lab = posteriors(logits.log_softmax(2), targets, il, tl)                       # label posteriors
    torch.testing.assert_close(lab.sum(-1), valid.double())

def test_forced_align_is_the_best_path():
    torch.manual_seed(0)
    N, T, C = 5, 12, 5
    lp = torch.randn(N, T, C, dtype=torch.float64).log_softmax(-1)
    targets, il, tl = torch.randint(1, C, (N, 4)), torch.tensor([12, 12, 10, 9, 12]), torch.tensor([4, 3, 4, 2, 0])
    labels, scores = forced_align(lp, targets, il, tl)
    assert labels.dtype == targets.dtype and scores.shape == (N, T)
    for n in range(N):
        path = labels[n, :il[n]].tolist()
        collapsed = [c for i, c in enumerate(path) if c != 0 and (i == 0 or c != path[i - 1])]
        assert collapsed == targets[n, :tl[n]].tolist()
        best = logz_brute_force(lp[n, :il[n]], targets[n, :tl[n]].tolist(), 0, Max) if il[n] <= 9 else \
            compute(lp[n:n+1].transpose(0, 1), targets[n:n+1], il[n:n+1], tl[n:n+1], True, 'none')[0][0]
        torch.testing.assert_close(scores[n, :il[n]].sum(), best)
        assert (labels[n, il[n]:] == 0).all() and (scores[n, il[n]:] == 0).all()

def test_seqdist_003_names():
    torch.manual_seed(0)
    logits, targets, il, tl = generate_sample_inputs(20, 30, 4, 6, 2, 5, device='cpu')
    logits = logits.double().detach().requires_grad_()
    expected = loss_pytorch(logits, targets, il, tl)
    for f in (loss_basic, loss_py, loss_cupy, loss_direct_cupy):
        torch.testing.assert_close(f(logits, targets, il, tl), expected)
    torch.testing.assert_close(CTCLoss(reduction='sum')(logits.log_softmax(2), targets, il, tl),
                               F.ctc_loss(logits.log_softmax(2), targets, il, tl, reduction='sum'))
    assert torch.equal(interleave_blanks(torch.tensor([[3, 4]]), 0), torch.tensor([[0, 3, 0, 4, 0]]))
    # Prob: 0.0.3's probability-space semiring; its forward pass gives Z itself
    z = ctc._logz_fwd(*ctc.prepare_inputs(logits.detach().softmax(2), targets, il, tl), ctc.Prob)
    torch.testing.assert_close(z.log(), -loss_pytorch(logits.detach(), targets, il, tl, reduction='none'))

def test_deterministic():
    torch.manual_seed(0)
    lp = torch.randn(50, 6, 7).log_softmax(2).requires_grad_()
    targets, il, tl = torch.randint(1, 7, (6, 10)), torch.full((6,), 50), torch.randint(0, 11, (6,))
    a = our_loss_and_grad(lp, targets, il, tl, 0, 'none', False)
    b = our_loss_and_grad(lp, targets, il, tl, 0, 'none', False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    torch.manual_seed(0)
    lp = torch.randn(20, 3, 6).log_softmax(2).to(dtype).requires_grad_()
    targets, il, tl = torch.randint(1, 6, (3, 5)), torch.full((3,), 20), torch.tensor([5, 3, 1])
    loss = ctc_loss(lp, targets, il, tl)
    loss.backward()
    assert loss.dtype == torch.float32 and lp.grad.dtype == dtype
    l32, g32 = our_loss_and_grad(lp.detach().float(), targets, il, tl, 0, 'mean', False)
    torch.testing.assert_close(loss.detach(), l32)
    torch.testing.assert_close(lp.grad.float(), g32, rtol=0, atol=1e-2)

@pytest.mark.parametrize('backend', ['auto', 'cuda'])      # cuda: the kernels' path, emulated (what runs on a GPU)
@pytest.mark.parametrize('C', [6, 40])                      # 40: more classes than states (state posteriors)
def test_torch_compile_fullgraph_gives_the_eager_result(backend, C):
    torch.manual_seed(0)
    lp = torch.randn(30, 4, C).log_softmax(2).requires_grad_()
    targets, il, tl = torch.randint(1, C, (4, 8)), torch.tensor([30, 25, 30, 20]), torch.tensor([8, 5, 3, 0])
    def f(lp): return ctc_loss(lp, targets, il, tl, backend=backend) * 2.0
    compiled = torch.compile(f, fullgraph=True, backend='aot_eager')
    eager, comp = f(lp), compiled(lp)
    g_eager, = torch.autograd.grad(eager, lp)
    g_comp, = torch.autograd.grad(comp, lp)
    assert torch.equal(eager, comp) and torch.equal(g_eager, g_comp)

def test_torch_compile_with_the_reference_backend():
    "torch.compile (graph breaks allowed) around ctc_loss(backend='reference'), which ran eagerly inside compiled code."
    torch.manual_seed(0)
    lp = torch.randn(30, 4, 6).log_softmax(2).requires_grad_()
    targets, il, tl = torch.randint(1, 6, (4, 8)), torch.tensor([30, 25, 30, 20]), torch.tensor([8, 5, 3, 0])
    def f(lp): return ctc_loss(lp, targets, il, tl, backend='reference') * 2.0
    eager, comp = f(lp), torch.compile(f, backend='aot_eager')(lp)
    assert torch.equal(eager, comp)
    assert torch.equal(torch.autograd.grad(eager, lp)[0], torch.autograd.grad(comp, lp)[0])

lp0 = torch.randn(6, 2, 5).log_softmax(2)
tg0, il0, tl0 = torch.tensor([[1, 2], [3, 4]]), torch.tensor([6, 6]), torch.tensor([2, 2])
BAD = [
    (dict(log_probs=lp0[0, 0]), ValueError, r"log_probs must have shape \(T, N, C\), or \(T, C\) unbatched, got \(5,\)"),
    (dict(log_probs=lp0[None]), ValueError, r"log_probs must have shape \(T, N, C\).*got \(1, 6, 2, 5\)"),
    (dict(log_probs=lp0.long()), TypeError, r"log_probs must be float16, bfloat16, float32 or float64, got torch.int64"),
    (dict(log_probs=lp0[:, :0]), ValueError, r"log_probs has an empty batch \(N = 0\)"),
    (dict(targets=tg0.float()), TypeError, r"targets must hold integer labels, got dtype torch.float32"),
    (dict(targets=tg0[:1]), ValueError, r"padded targets must have shape \(N, S\) with N = 2, got \(1, 2\)"),
    (dict(targets=torch.tensor([[1, 7], [3, 4]])), ValueError, r"targets must hold labels in \[0, C\) = \[0, 5\), got \[7\]"),
    (dict(targets=torch.tensor([[1, 0], [3, 4]])), ValueError, r"targets contain the blank label 0 within their target_lengths"),
    (dict(targets=torch.tensor([1, 2, 3])), ValueError, r"concatenated targets have 3 labels but target_lengths sum to 4"),
    (dict(input_lengths=torch.tensor([6, 7])), ValueError, r"input_lengths must be in \[0, T\] = \[0, 6\], got \[7\]"),
    (dict(input_lengths=torch.tensor([-1, 6])), ValueError, r"input_lengths must be in \[0, T\] = \[0, 6\], got \[-1\]"),
    (dict(target_lengths=torch.tensor([3, 2])), ValueError, r"target_lengths \(max 3\) exceed the padded targets' length 2"),
    (dict(target_lengths=torch.tensor([-1, 2])), ValueError, r"target_lengths must be >= 0, got \[-1\]"),
    (dict(input_lengths=torch.tensor([6.0, 6.0])), TypeError, r"input_lengths must hold integers, got dtype torch.float32"),
    (dict(input_lengths=torch.tensor([6, 6, 6])), ValueError, r"input_lengths must have shape \(2,\), one length per sequence, got \(3,\)"),
    (dict(target_lengths=torch.tensor([2, 2], device='meta')), ValueError, r"target_lengths is on meta: it must be on the CPU or on cpu"),
    (dict(input_lengths='6'), TypeError, r"input_lengths must be a tensor, list or tuple of ints, got str"),
    (dict(blank=5), ValueError, r"blank must be an int in \[0, C\) = \[0, 5\), got 5"),
    (dict(reduction='avg'), ValueError, r"reduction must be 'none', 'sum' or 'mean', got 'avg'"),
    (dict(backend='gpu'), ValueError, r"backend must be 'auto', 'cpu', 'cuda' or 'reference', got 'gpu'"),
    (dict(delay_penalty=math.inf), ValueError, r"delay_penalty must be finite, got inf"),
    (dict(delay_penalty=math.nan), ValueError, r"delay_penalty must be finite, got nan"),
    (dict(delay_penalty='0.1'), TypeError, r"delay_penalty must be a real number, got '0.1'"),
    (dict(delay_penalty=None), TypeError, r"delay_penalty must be a real number, got None"),
    (dict(delay_penalty=True), TypeError, r"delay_penalty must be a real number, got True"),
]

@pytest.mark.parametrize('bad,error,message', BAD)
def test_bad_input_is_a_clear_error(bad, error, message):
    args = dict(log_probs=lp0, targets=tg0, input_lengths=il0, target_lengths=tl0)
    args.update(bad)
    with pytest.raises(error, match=message): ctc_loss(**args)

def test_torch_compile_inductor_fullgraph():
    "The default backend compiles the surrounding code too (log_softmax is fused, hence a tolerance)."
    torch.manual_seed(0)
    x = torch.randn(30, 4, 6).requires_grad_()
    targets, il, tl = torch.randint(1, 6, (4, 8)), torch.tensor([30, 25, 30, 20]), torch.tensor([8, 5, 3, 0])
    def f(x): return ctc_loss(x.log_softmax(2), targets, il, tl) * 2.0
    eager, comp = f(x), torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(comp, x)[0], torch.autograd.grad(eager, x)[0], rtol=1e-5, atol=1e-6)

@pytest.mark.torchaudio
@pytest.mark.parametrize('seed', range(4))
def test_forced_align_equals_torchaudio(seed):
    from seqdist.timing import load_torchaudio
    fa = load_torchaudio().functional.forced_align
    g = torch.Generator().manual_seed(seed)
    N, T, C = 6, 40, 7
    lp = torch.randn(N, T, C, generator=g).log_softmax(2)
    tl = torch.randint(1, 12, (N,), generator=g)          # torchaudio refuses empty targets
    il = torch.randint(30, T + 1, (N,), generator=g)
    targets = torch.randint(1, C, (N, 12), generator=g)
    targets[:, 1::3] = targets[:, 0::3][:, :targets[:, 1::3].shape[1]]   # repeated labels
    labels, scores = forced_align(lp, targets, il, tl)
    for n in range(N):
        ref_labels, ref_scores = fa(lp[n:n+1, :il[n]], targets[n:n+1, :tl[n]].int(), blank=0)
        assert torch.equal(labels[n, :il[n]], ref_labels[0].long())
        assert torch.allclose(scores[n, :il[n]], ref_scores[0], atol=1e-6)

@pytest.mark.parametrize('max_threads', [1024, 32])     # 32: 16 threads per recursion, up to 32 states each
@pytest.mark.parametrize('two_launches', [False, True])  # True: as for targets too long for both recursions' frames
def test_cuda_recursions_meet_at_every_length(max_threads, two_launches, monkeypatch):
    """The CUDA kernel runs the forward and backward recursions at once and they meet in the middle of the frames:
    odd and even lengths (the backward half starts a step late for odd T), T = 1, lengths shorter than the batch's,
    and targets with more states than 4 per thread (the wider register variant). Or, when four frames do not fit
    in shared memory, one launch after the other."""
    if two_launches: monkeypatch.setattr(ctc, 'EMULATOR_MAX_SHARED_MEM', ctc._POISON_BYTES + 2 * 81 * 8)   # two frames of 81 states
    monkeypatch.setenv('SEQDIST_CTC_VARIANT', 'both')             # (the one-block kernel; the variants: below)
    with launch_limits(max_threads=max_threads):
        torch.manual_seed(3)
        T, N, C = 90, 8, 5
        lp = torch.randn(T, N, C, dtype=torch.float64).log_softmax(2)
        targets = torch.randint(1, C, (N, 40))
        il, tl = torch.tensor([1, 2, 3, 4, 7, 8, 89, 90]), torch.tensor([0, 1, 1, 2, 3, 4, 40, 33])
        for S in (Log, Max):
            ref = compute(lp, targets, il, tl, S is Max, 'labels', 'reference')
            out = compute(lp, targets, il, tl, S is Max, 'labels', 'cuda')
            torch.testing.assert_close(out[0], ref[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out[1], ref[1], rtol=1e-12, atol=1e-12)
            logz_only = compute(lp, targets, il, tl, S is Max, 'none', 'cuda')[0]      # the forward half alone
            torch.testing.assert_close(logz_only, ref[0], rtol=1e-12, atol=1e-12)
        from seqdist.utils import count_launches
        with count_launches() as launches: compute(lp, targets, il, tl, False, 'labels', 'cuda')
        assert launches['ctc_alpha_beta'] == (2 if two_launches else 1)

def test_cuda_targets_too_long_for_shared_memory():
    lp = torch.randn(22000, 1, 3).log_softmax(2)
    targets, il, tl = torch.ones(1, 10500, dtype=torch.long), torch.tensor([22000]), torch.tensor([10500])
    with pytest.raises(ValueError, match=r"targets of 10500 labels are longer than the CUDA kernel holds .*10430 labels in torch.float32"):
        compute(lp, targets, il, tl, False, 'labels', 'cuda')

@pytest.mark.parametrize('variant', ['both', 'split', 'smem', 'split+smem', 'split+smem+log2'])
def test_cuda_recursion_finds_every_poisoned_sequence(variant, monkeypatch):
    """logZ is NaN exactly where the lattice reads a NaN, a +inf or a log-probability of HUGE_LOG_PROB or more
    (`poisoned_sequences`, the definition the CPU path applies): the forward recursion flags it as it reads the
    emissions, in every variant and launch shape (both recursions in one block, a block each, one launch after the
    other; several states a thread), at the first and last frames and states, the blank, a thread's later states;
    never past an input length or at a class no label reads."""
    monkeypatch.setenv('SEQDIST_CTC_VARIANT', variant)
    torch.manual_seed(5)
    T, N, C = 30, 6, 5
    dtype = torch.float32 if 'log2' in variant else torch.float64      # (log2: float's alone)
    lp = torch.randn(T, N, C, dtype=torch.float64).log_softmax(2).to(dtype)
    targets = torch.randint(1, C - 1, (N, 17))                        # class C - 1: read by no label
    il, tl = torch.tensor([30, 29, 12, 30, 0, 1]), torch.tensor([17, 0, 5, 12, 0, 1])
    ext = ctc.interleave_blanks(ctc.padded_targets(lp, targets, il, tl, 0), 0)
    rng = random.Random(0)
    spots = [(0, 0, int(targets[0, 0])), (29, 0, int(targets[0, 16])), (28, 1, 0), (11, 2, int(targets[2, 4])),
             (12, 2, int(targets[2, 4])), (5, 3, C - 1), (0, 4, 0), (0, 5, int(targets[5, 0]))]
    spots += [(rng.randrange(T), rng.randrange(N), rng.randrange(C)) for _ in range(6)]
    for max_threads in (32, 8):
        for (t, n, c), value in zip(spots, [math.nan, math.inf, 2e4] * 5):
            x = lp.clone(); x[t, n, c] = value
            want = ctc.poisoned_sequences(x, ext, il)
            want = torch.zeros(N, dtype=torch.bool) if want is None else want
            for posteriors_of in ('labels', 'none'):
                with launch_limits(max_threads=max_threads):
                    logz = compute(x, targets, il, tl, False, posteriors_of, 'cuda')[0]
                assert torch.equal(logz.isnan(), want), ((t, n, c), value, max_threads, posteriors_of, logz)

@pytest.mark.parametrize('variant', ['both', 'split+smem'])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_cuda_posteriors_a_warp_a_frame_equal_a_thread_a_frame(variant, dtype, monkeypatch):
    """SEQDIST_CTC_POSTERIORS=warp (a warp a frame, for a GPU run to decide) gives ctc_posteriors' posteriors: Max's
    exactly (the first best state), Log's to rounding (the sums run in another order), by state and by label with
    labels repeated in a target (a label's states summed by one lane along `links`), adjacent repeats, the blank,
    zero-length and infeasible targets, lengths shorter than T, more states than a warp; and its sums are the same
    at every call (no atomics)."""
    monkeypatch.setenv('SEQDIST_CTC_VARIANT', variant)
    torch.manual_seed(6)
    T, N, C = 40, 6, 6
    lp = torch.randn(T, N, C, dtype=torch.float64).log_softmax(2).to(dtype)
    targets = torch.randint(1, C, (N, 30)); targets[1, :6] = torch.tensor([2, 3, 2, 2, 5, 2]); targets[4, :3] = 4
    il, tl = torch.tensor([40, 37, 12, 40, 3, 0]), torch.tensor([30, 6, 5, 17, 3, 0])      # (4: infeasible)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for use_max, posteriors_of in ((False, 'labels'), (True, 'labels'), (False, 'states'), (True, 'states')):
        monkeypatch.setenv('SEQDIST_CTC_POSTERIORS', 'thread')
        want = compute(lp, targets, il, tl, use_max, posteriors_of, 'cuda')[1]
        monkeypatch.setenv('SEQDIST_CTC_POSTERIORS', 'warp')
        got, again = (compute(lp, targets, il, tl, use_max, posteriors_of, 'cuda')[1] for _ in range(2))
        assert torch.equal(got, again)
        if use_max: assert torch.equal(got, want)
        else: torch.testing.assert_close(got, want, **tol)
    monkeypatch.setenv('SEQDIST_CTC_POSTERIORS', 'wrap')
    with pytest.raises(ValueError, match="SEQDIST_CTC_POSTERIORS must be 'thread' or 'warp', got 'wrap'"):
        compute(lp, targets, il, tl, False, 'labels', 'cuda')

@pytest.mark.parametrize('variant', ['split', 'smem', 'split+smem', '', 'smem+log2', 'split+smem+log2'])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_cuda_variants_equal_the_default(variant, dtype, monkeypatch):
    """The recursion's variants (SEQDIST_CTC_VARIANT, for a GPU run to decide between) give the default's logZ and
    posteriors: Log and Max, with a delay penalty or not, odd and even lengths shorter than T, a zero-length target,
    repeats, labels or state posteriors or logZ alone. Blocks of 32 threads: the default holds 3 states a thread (16 a
    recursion), split 2; of 16: split 3, smem's recursions one launch after the other; of 8: too long for a variant,
    the default's path. log2 (float Log's sums in base 2; elsewhere the variant without it): to float32's rounding,
    its scores scaled by log2 e and back."""
    torch.manual_seed(4)
    T, N, C = 30, 6, 5
    lp = torch.randn(T, N, C, dtype=torch.float64).log_softmax(2).to(dtype)
    targets = torch.randint(1, C, (N, 17)); targets[2, 3] = targets[2, 2]; targets[3, 5:9] = 2
    il, tl = torch.tensor([30, 29, 12, 30, 0, 1]), torch.tensor([17, 0, 5, 12, 0, 1])
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5) if 'log2' in variant else dict(rtol=1e-6, atol=1e-6)
    for max_threads in (32, 16, 8):
        for S, delay, posteriors_of in ((Log, 0.0, 'labels'), (Max, 0.0, 'labels'), (Log, 0.3, 'states'), (Max, 0.3, 'none')):
            run = lambda: compute(lp, targets, il, tl, S is Max, posteriors_of, 'cuda', delay=delay)
            with launch_limits(max_threads=max_threads):
                monkeypatch.setenv('SEQDIST_CTC_VARIANT', 'both'); default = run()       # (the one-block kernel)
                monkeypatch.setenv('SEQDIST_CTC_VARIANT', variant); out = run()
            assert torch.isfinite(default[0][[0, 1, 2, 3, 5]]).all()
            torch.testing.assert_close(out[0], default[0], **tol); torch.testing.assert_close(out[1], default[1], **tol)
    monkeypatch.setenv('SEQDIST_CTC_VARIANT', 'spilt')
    with pytest.raises(ValueError, match="SEQDIST_CTC_VARIANT must be one of 'both', 'split', 'smem', 'split\\+smem', "
                       "'smem\\+log2', 'split\\+smem\\+log2', got 'spilt'"):
        run()

@pytest.mark.parametrize('max_threads', [1024, 32])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_forced_align_cuda_kernel_equals_the_cpu_kernel(max_threads, dtype):
    """The CUDA Viterbi kernel (emulated) finds the CPU kernel's path: random scores, repeated labels, frames past the
    input length, a sequence that just fits its frames, and scores where every path ties (the same first-of-equals
    rule on both, and the same double sums)."""
    g = torch.Generator().manual_seed(5)
    N, T, C = 6, 50, 6
    targets = torch.randint(1, C, (N, 24), generator=g)
    targets[:, 1::2] = targets[:, 0::2]                               # repeats: need a blank between them
    il, tl = torch.tensor([50, 44, 30, 5, 50, 1]), torch.tensor([24, 10, 3, 3, 0, 1])   # sequence 3: 3 labels + 2 repeats in 5 frames
    for lp in (torch.randn(N, T, C, generator=g).log_softmax(2), torch.full((N, T, C), -math.log(C))):
        lp = lp.to(dtype)
        with launch_limits(max_threads=max_threads):
            cpu, cuda = (forced_align(lp, targets, il, tl, backend=b) for b in ('cpu', 'cuda'))
        assert torch.equal(cpu[0], cuda[0]) and torch.equal(cpu[1], cuda[1])
    assert (cuda[0][3] != 0).sum() == 3
    with pytest.raises(ValueError, match="backend must be"): forced_align(lp, targets, il, tl, backend='numba')
    # (targets of any length: tests/test_align.py runs the kernel across blocks and from checkpoints)

@pytest.mark.parametrize('C', [5, 40])            # 5: label posteriors (want=1); 40: more classes than states (want=2)
@pytest.mark.parametrize('zero_infinity', [False, True])
def test_label_gradient_on_the_cuda_path(C, zero_infinity):
    """The backward pass's kernels (emulated): one pass writes the labels' gradient, and with more classes than states
    a kernel adds the states' posteriors into their labels (one thread per frame, in state order: deterministic, where
    scatter_add_ uses atomics on a GPU). Same gradient as PyTorch's: blanks, repeated labels, short inputs, an
    infeasible sequence (NaN, or 0 with zero_infinity)."""
    torch.manual_seed(4)
    T, N = 30, 5
    logits = torch.randn(T, N, C, dtype=torch.float64)
    targets = torch.randint(1, C, (N, 6)); targets[0, 1] = targets[0, 0]
    il, tl = torch.tensor([30, 25, 30, 12, 3]), torch.tensor([6, 4, 0, 5, 6])      # the last: 6 labels in 3 frames
    def grad(f):
        x = logits.clone().requires_grad_()
        return torch.autograd.grad(f(x.log_softmax(2)), x)[0]
    ref = grad(lambda lp: F.ctc_loss(lp, targets, il, tl, reduction='sum', zero_infinity=zero_infinity))
    for backend in ('cpu', 'cuda'):
        got = grad(lambda lp: ctc_loss(lp, targets, il, tl, reduction='sum', zero_infinity=zero_infinity, backend=backend))
        torch.testing.assert_close(got, ref, equal_nan=True)

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_the_ops_pass_opcheck(backend):
    "Eager calls go through an autograd.Function (less host time); torch.compile traces the ops: check them as ops."
    torch.manual_seed(0)
    lp = torch.randn(12, 3, 9, dtype=torch.float64).log_softmax(2).requires_grad_()
    targets, il, tl = torch.randint(1, 9, (3, 3)), torch.tensor([12, 10, 12]), torch.tensor([3, 2, 0])
    for posteriors_of in ('labels', 'states'):
        inputs = (lp, targets, il, tl, 0, False, posteriors_of, False, True, False, 0.3)
        torch.library.opcheck(ctc_op.custom_op, (*inputs, backend))
        logz, minus_posteriors = ctc_op.compute(*inputs, backend=backend)      # the backward op (not differentiable)
        torch.library.opcheck(ctc_op.backward_op, (lp.detach(), *inputs[1:], logz, minus_posteriors,
                                                   torch.randn(3, dtype=torch.float64), None, backend))

def test_cuda_float32_posteriors_are_more_accurate_than_pytorchs():
    """A long sequence in float32: alpha and beta reach thousands, so their rounding dominates exp(alpha + beta - logZ).
    The CUDA kernel normalises each frame by its own total (Z in exact arithmetic), which cancels the rounding that a
    frame shares: its gradient error against float64 is well under PyTorch's own float32 error (here 6e-5 vs 9e-4)."""
    torch.manual_seed(0)
    T, N, C, L = 1000, 2, 5, 200
    lp = torch.randn(T, N, C, dtype=torch.float64).log_softmax(2)
    targets, il, tl = torch.randint(1, C, (N, L)), torch.full((N,), T), torch.full((N,), L)
    def grad(f, x):
        x = x.clone().requires_grad_()
        return torch.autograd.grad(f(x), x)[0].double()
    exact = grad(lambda x: F.ctc_loss(x, targets, il, tl, reduction='sum'), lp)
    pytorch = (grad(lambda x: F.ctc_loss(x, targets, il, tl, reduction='sum'), lp.float()) - exact).abs().max()
    ours = (grad(lambda x: ctc_loss(x, targets, il, tl, reduction='sum', backend='cuda'), lp.float()) - exact).abs().max()
    assert ours < pytorch / 3, (ours, pytorch)

INFEASIBLE_SCRIPT = r'''
import math, torch
from seqdist import ctc, ctc_simple
from seqdist.crf import CTC_CRF
from seqdist.core import Log, Max
def outcome(f):
    try: return ('ok', f())
    except ValueError as e: return ('ValueError', str(e))
results = {}
for seed in range(6):
    for case, target in (('repeat_at_end', [0, 1, 2, 3, 4, 4]), ('repeat_inside', [0, 1, 2, 2, 3])):
        g = torch.Generator().manual_seed(seed)
        N, T, C, blank = 2, 5, 6, 5
        lp = torch.randn(N, T, C, generator=g, dtype=torch.float64).log_softmax(2)      # (N, T, C)
        targets = torch.tensor([target, [3, 1, 0, 0, 0, 0][:len(target)]])           # sequence 1 fits its frames
        il, tl = torch.tensor([T, T]), torch.tensor([len(target), 2])
        for backend in ('cpu', 'cuda'):
            results[seed, case, 'forced_align', backend] = outcome(lambda: ctc.forced_align(lp, targets, il, tl, blank, backend=backend))
        for backend in ('cpu', 'cuda', 'reference'):
            lpt = lp.transpose(0, 1)
            for by_state in (False, True):
                results[seed, case, 'posteriors_max', backend, by_state] = outcome(
                    lambda: ctc.posteriors(lpt, targets, il, tl, blank, Max, by_state, backend))
                results[seed, case, 'posteriors_log', backend, by_state] = outcome(
                    lambda: ctc.posteriors(lpt, targets, il, tl, blank, Log, by_state, backend))
            for use_max in (False, True):        # the kernels themselves, no check before them: logZ = -inf, P = 0
                results[seed, case, 'compute', backend, use_max] = outcome(
                    lambda: ctc.ctc_op.compute(lpt, targets, il, tl, blank, use_max, 'labels', False, False, False, 0.0, backend=backend))
            for zero_infinity in (False, True):
                results[seed, case, 'loss', backend, zero_infinity] = outcome(lambda: ctc.ctc_loss(
                    lpt.detach().requires_grad_(), targets, il, tl, blank, 'none', zero_infinity, backend=backend).detach())
        shifted = (targets + 1) % C                                  # blank 0 for 0.0.3's viterbi_alignments
        results[seed, case, 'viterbi_alignments'] = outcome(lambda: ctc.viterbi_alignments(lp.transpose(0, 1), shifted, il, tl))
    stay, move = torch.randn(3, 2, 6, generator=g), torch.randn(3, 2, 5, generator=g)   # T = 3: at most 4 states
    results[seed, 'simple', 'viterbi_alignments'] = outcome(lambda: ctc_simple.viterbi_alignments(stay, move, torch.tensor([4, 5])))
    results[seed, 'simple', 'soft_alignments'] = outcome(lambda: ctc_simple.soft_alignments(stay, move, torch.tensor([4, 5])))
    crf = CTC_CRF(state_len=2, alphabet='NACGT')
    scores = torch.randn(3, 2, crf.n_score(), generator=g)
    results[seed, 'crf', 'ctc_viterbi_alignments'] = outcome(lambda: crf.ctc_viterbi_alignments(
        scores, torch.tensor([[1, 2, 3, 4, 1, 0], [1, 2, 3, 4, 1, 2]]), torch.tensor([5, 6])))   # 4, 5 k-mers in 3 frames
torch.save(results, OUT)
'''

def test_infeasible_targets_every_entry_point_and_backend(tmp_path):
    """Targets that cannot fit their frames (T=5: 6 labels with a repeat; 5 labels with a repeat) beside a sequence
    that fits, on every backend, in a subprocess (a crash inside a kernel fails this test instead of killing pytest):
    the alignment functions raise a ValueError naming the sequence, its labels, repeats and frames (as torchaudio's
    "targets length is too long for CTC"); the loss is inf (0 with zero_infinity) with a zero gradient; Log posteriors
    are zero; the kernels called directly (no check before them) give logZ = -inf and P = 0 for that sequence and the
    right answer for the other one."""
    out = tmp_path / 'results.pt'
    script = f"OUT = {str(out)!r}\n" + INFEASIBLE_SCRIPT
    r = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"the subprocess died (return code {r.returncode}): {r.stderr[-2000:]}"
    results = torch.load(out, weights_only=False)
    feasible_ref = {}
    for key, (kind, value) in results.items():
        seed, case, what = key[:3]
        if case in ('simple', 'crf'):
            if what == 'soft_alignments':
                assert kind == 'ok' and torch.equal(value[:, 1], torch.zeros_like(value[:, 1])) and value[:, 0].sum() == 3, key
            else:
                assert kind == 'ValueError' and 'too long for alignment: sequence 1 has 5 states' in value, (key, value)
            continue
        labels, repeats, frames = (6, 1, 7) if case == 'repeat_at_end' else (5, 1, 6)
        message = (f"targets length is too long for CTC alignment: sequence 0 has {labels} target labels and {repeats} "
                   f"adjacent repeats, which need {frames} frames, but input_lengths[0] = 5")
        if what in ('forced_align', 'posteriors_max', 'viterbi_alignments'):
            assert kind == 'ValueError' and value == message, (key, kind, value)
        elif what == 'posteriors_log':
            assert kind == 'ok' and torch.equal(value[:, 0], torch.zeros_like(value[:, 0])), key
            torch.testing.assert_close(value[:, 1].sum(-1), torch.ones(5, dtype=torch.float64))
        elif what == 'compute':
            logz, P = value
            assert kind == 'ok' and logz[0] == -math.inf and torch.isfinite(logz[1]) and torch.equal(P[:, 0], torch.zeros_like(P[:, 0])), key
            ref = feasible_ref.setdefault((seed, case, key[4]), (logz[1], P[:, 1]))
            torch.testing.assert_close(logz[1], ref[0]); torch.testing.assert_close(P[:, 1], ref[1])
        elif what == 'loss':
            assert kind == 'ok' and value[0] == (0.0 if key[4] else math.inf) and torch.isfinite(value[1]), key


# k2's CTC delay penalty: delay_penalty * (T_b // 2 - t) added to a path's score for the first frame t of each label

def test_delay_brute_force_is_k2s_definition():
    "Written out for T = 3 frames, one label (1), blank 0: each labelling's score plus delay * (3 // 2 - its first frame of 1)."
    torch.manual_seed(30)
    lp = torch.randn(3, 2, dtype=torch.float64).log_softmax(-1)
    dp = 0.4
    paths = {(1, 0, 0): 0, (1, 1, 0): 0, (1, 1, 1): 0, (0, 1, 0): 1, (0, 1, 1): 1, (0, 0, 1): 2}   # labelling: first frame of 1
    want = torch.stack([lp[[0, 1, 2], list(p)].sum() + dp * (1 - t) for p, t in paths.items()]).logsumexp(0)
    torch.testing.assert_close(logz_brute_force(lp, [1], 0, Log, dp), want, rtol=1e-14, atol=0)

@pytest.mark.parametrize('S', [Log, Max])
def test_delay_equals_brute_force_of_k2s_definition(S):
    "Every path (reference, CPU, CUDA source) against enumeration; even and odd lengths; repeats, empty and infeasible targets."
    torch.manual_seed(31)
    C = 3
    for target in ([1], [1, 2], [2, 2], [], [1, 2, 1], [1, 1, 1], [2, 1, 2]):
        for T in (4, 5):
            lp = torch.randn(T, 1, C, dtype=torch.float64).log_softmax(2)
            tg = torch.tensor([target + [0] * (3 - len(target))])
            for il, dp in ((T, 0.3), (T - 1, -0.7), (T, 2.0)):
                truth = logz_brute_force(lp[:il, 0], target, 0, S, dp)
                for backend in ('reference', 'cpu', 'cuda'):
                    logz, _ = compute(lp, tg, torch.tensor([il]), torch.tensor([len(target)]), S is Max, 'none', backend, delay=dp)
                    if truth == -math.inf: assert logz.item() == -math.inf, (backend, target)
                    else: torch.testing.assert_close(logz[0], truth, rtol=1e-12, atol=1e-12)

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
def test_delay_gradient_through_log_softmax_equals_brute_force(backend):
    """The loss and its gradient w.r.t. raw logits x (through log_softmax: PyTorch's convention for the gradient w.r.t.
    log_probs is comparable there) equal autograd through brute-force enumeration of k2's definition."""
    torch.manual_seed(32)
    for target in ([1, 2], [2, 2], [1, 2, 1], []):
        for T in (4, 5):
            x = torch.randn(T, 1, 3, dtype=torch.float64, requires_grad=True)
            tg, dp = torch.tensor([target + [0] * (3 - len(target))]), 0.25
            ours = ctc_loss(x.log_softmax(2), tg, [T], [len(target)], reduction='sum', delay_penalty=dp, backend=backend)
            truth = -logz_brute_force(x.log_softmax(2)[:, 0], target, 0, Log, dp)
            torch.testing.assert_close(ours, truth, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(torch.autograd.grad(ours, x)[0], torch.autograd.grad(truth, x)[0], rtol=1e-10, atol=1e-12)

def test_delay_state_offsets_sum_to_k2s_penalty_on_every_path():
    "The identity the kernels use: on every labelling that fits the target, offsets over its states + the shift = k2's penalty."
    import itertools
    for T, target in ((5, [1, 2]), (6, [1, 1]), (5, [2, 1, 2]), (4, [])):     # (2L+1)^T state sequences each
        L, dp = len(target), 0.3
        ext = interleave_blanks(torch.tensor([target]), 0)[0].tolist()
        offsets, shift = delay_state_offsets(torch.tensor([T]), torch.tensor([L]), 2 * L + 1, dp)
        for states in itertools.product(range(2 * L + 1), repeat=T):      # state paths through the lattice
            steps = [b - a for a, b in zip(states, states[1:])]
            if states[0] > 1 or states[-1] < 2 * L - 1 or any(d not in (0, 1, 2) for d in steps): continue
            if any(d == 2 and (ext[b] == 0 or ext[b] == ext[b - 2]) for d, b in zip(steps, states[1:])): continue
            firsts = [t for t in range(T) if states[t] % 2 == 1 and (t == 0 or states[t - 1] != states[t])]
            k2 = sum(dp * (T // 2 - t) for t in firsts)
            ours = sum(offsets[0, s].item() for s in states) + shift[0].item()
            assert abs(ours - k2) < 1e-12, (T, target, states)

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_delay_three_paths_agree_on_random_cases(dtype):
    "Variable lengths, repeats, garbage padding, any blank, every reduction, zero_infinity, infeasible targets."
    rng = random.Random(33 if dtype == torch.float64 else 34)
    for case in range(40):
        lp, targets, il, tl, blank = random_case(rng, dtype)
        reduction, zero_inf, dp = rng.choice(['none', 'sum', 'mean']), rng.random() < 0.5, rng.choice([0.01, 0.3, -0.2, 3.0])
        truth = our_loss_and_grad(lp.double(), targets, il, tl, blank, reduction, zero_inf, 'reference', dp)
        for backend in ('reference', 'cpu', 'cuda'):
            with emulator_options(seed=case):
                out = our_loss_and_grad(lp, targets, il, tl, blank, reduction, zero_inf, backend, dp)
            if dtype == torch.float64:
                assert_same(out[0], truth[0], rtol=1e-9, atol=1e-12); assert_same(out[1], truth[1], rtol=1e-9, atol=1e-12)
            else:      # (the float32 reference's and CUDA kernel's log-space recursions round in float32)
                atol = 1e-6 if backend == 'cpu' else 1e-4
                assert_same(out[0], truth[0], rtol=atol, atol=atol); assert_same(out[1], truth[1], rtol=0, atol=atol)

@pytest.mark.parametrize('S', [Log, Max])
@pytest.mark.parametrize('max_threads', [1024, 32])
@pytest.mark.parametrize('by_state', [False, True])
def test_delay_posteriors_agree_on_every_path(S, max_threads, by_state):
    torch.manual_seed(35)
    T, N, C = 14, 3, 6
    lp = torch.randn(T, N, C, dtype=torch.float64).log_softmax(2)
    targets = torch.randint(1, C, (N, 30)); targets[0, 5] = targets[0, 4]
    il, tl = torch.tensor([14, 13, 0]), torch.tensor([6, 30 if by_state else 4, 0])
    tl[1] = 6
    posteriors_of = 'states' if by_state else 'labels'
    ref = compute(lp, targets, il, tl, S is Max, posteriors_of, 'reference', delay=0.4)
    assert not torch.equal(ref[1], compute(lp, targets, il, tl, S is Max, posteriors_of, 'reference')[1])
    for backend in ('cpu', 'cuda'):
        with emulator_options(seed=1), launch_limits(max_threads=max_threads):
            out = compute(lp, targets, il, tl, S is Max, posteriors_of, backend, delay=0.4)
        torch.testing.assert_close(out[0], ref[0], rtol=1e-12, atol=1e-12); torch.testing.assert_close(out[1], ref[1], rtol=1e-12, atol=1e-12)
    post = posteriors(lp, targets, il, tl, 0, S, by_state, delay_penalty=0.4)
    torch.testing.assert_close(post, 0.0 - ref[1])
    torch.testing.assert_close(post.sum(-1), (torch.arange(T)[:, None] < il[None]).double())   # one distribution per frame

def test_delay_long_and_strong_inputs_stay_exact():
    "The CPU kernel's scaled recursion with the state offsets (and its log-space fallback) against the float64 reference."
    torch.manual_seed(36)
    T, N, C, L = 400, 2, 8, 120
    lp = torch.randn(T, N, C, dtype=torch.float64).log_softmax(2)
    targets, il, tl = torch.randint(1, C, (N, L)), torch.tensor([T, T - 9]), torch.tensor([L, L - 5])
    for dp in (0.01, 1.0, 20.0):
        ref = our_loss_and_grad(lp, targets, il, tl, 0, 'none', False, 'reference', dp)
        cpu = our_loss_and_grad(lp, targets, il, tl, 0, 'none', False, 'cpu', dp)
        assert torch.isfinite(cpu[0]).all()
        assert_same(cpu[0], ref[0], rtol=1e-10); assert_same(cpu[1], ref[1], rtol=1e-8, atol=1e-10)

def test_delay_gradcheck_through_log_softmax():
    torch.manual_seed(37)
    x = torch.randn(8, 3, 5, dtype=torch.float64, requires_grad=True)
    targets, il, tl = torch.tensor([[1, 2, 2], [3, 4, 0], [1, 0, 0]]), torch.tensor([8, 7, 5]), torch.tensor([3, 2, 1])
    for backend in ('cpu', 'reference', 'cuda'):
        f = lambda x: ctc_loss(x.log_softmax(2), targets, il, tl, delay_penalty=0.3, backend=backend)
        assert torch.autograd.gradcheck(f, (x,))

@pytest.mark.parametrize('backend', ['auto', 'cuda'])
def test_delay_torch_compile_fullgraph_gives_the_eager_result(backend):
    torch.manual_seed(38)
    lp = torch.randn(30, 4, 6).log_softmax(2).requires_grad_()
    targets, il, tl = torch.randint(1, 6, (4, 8)), torch.tensor([30, 25, 30, 20]), torch.tensor([8, 5, 3, 0])
    def f(lp): return ctc_loss(lp, targets, il, tl, delay_penalty=0.1, backend=backend) * 2.0
    compiled = torch.compile(f, fullgraph=True, backend='aot_eager')
    eager, comp = f(lp), compiled(lp)
    assert not torch.equal(eager, ctc_loss(lp, targets, il, tl, backend=backend) * 2.0)
    assert torch.equal(eager, comp) and torch.equal(torch.autograd.grad(eager, lp)[0], torch.autograd.grad(comp, lp)[0])

def test_delay_module_equals_function_and_posteriors_check_it():
    torch.manual_seed(39)
    lp = torch.randn(10, 2, 5).log_softmax(2)
    targets, il, tl = torch.tensor([[1, 2, 3], [4, 4, 0]]), torch.tensor([10, 8]), torch.tensor([3, 2])
    assert torch.equal(CTCLoss(reduction='sum', delay_penalty=0.2)(lp, targets, il, tl),
                       ctc_loss(lp, targets, il, tl, 0, 'sum', False, 0.2))
    with pytest.raises(ValueError, match=r"delay_penalty must be finite, got inf"): posteriors(lp, targets, il, tl, delay_penalty=math.inf)
    with pytest.raises(TypeError, match=r"delay_penalty must be a real number, got '1'"): posteriors(lp, targets, il, tl, delay_penalty='1')
