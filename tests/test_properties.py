"""Property tests (hypothesis): random valid shapes, lengths, labels and dtypes for each family, its kernels against its
reference (and the anchors PyTorch defines), values and gradients. A small budget per family, derandomised (the same
examples on every run: conftest's profile), so `make test` stays quick and a failure reproduces."""
import pytest, torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from seqdist import ctc, rnnt, tdt, ctc_simple, cross_entropy
from seqdist.crf import CTC_CRF

DTYPES = st.sampled_from([torch.float32, torch.float64])
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: dict(rtol=1e-9, atol=1e-9)}

def _value_and_grad(call, x):
    x = x.detach().clone().requires_grad_()
    v = call(x)
    v.sum().backward()
    return v.detach(), x.grad

def _agree(a, b, dtype):
    (va, ga), (vb, gb) = a, b
    torch.testing.assert_close(va, vb, **TOL[dtype], equal_nan=True)
    torch.testing.assert_close(ga, gb, **TOL[dtype], equal_nan=True)

@st.composite
def ctc_cases(draw):
    "log_probs (T, N, C), targets that fit their frames (or not: an infeasible one is +inf), lengths, a blank."
    N, C, T = draw(st.integers(1, 3)), draw(st.integers(2, 6)), draw(st.integers(1, 8))
    blank = draw(st.integers(0, C - 1))
    il = torch.tensor(draw(st.lists(st.integers(0, T), min_size=N, max_size=N)))
    tl = torch.tensor(draw(st.lists(st.integers(0, 4), min_size=N, max_size=N)))
    labels = [c for c in range(C) if c != blank]
    y = torch.tensor(draw(st.lists(st.lists(st.sampled_from(labels), min_size=4, max_size=4), min_size=N, max_size=N)))
    dtype, seed = draw(DTYPES), draw(st.integers(0, 2**16))
    lp = torch.randn(T, N, C, generator=torch.Generator().manual_seed(seed), dtype=dtype).log_softmax(-1)
    return lp, y, il, tl, blank, dtype

@settings(max_examples=40)
@given(case=ctc_cases())
def test_ctc_loss_cpu_equals_pytorch_and_the_reference(case):
    lp, y, il, tl, blank, dtype = case
    ours = lambda b: _value_and_grad(lambda x: ctc.ctc_loss(x, y, il, tl, blank=blank, reduction='none', backend=b), lp)
    theirs = _value_and_grad(lambda x: F.ctc_loss(x, y, il, tl, blank=blank, reduction='none'), lp)
    cpu = ours('cpu')
    _agree(cpu, ours('reference'), dtype)
    feasible = torch.isfinite(theirs[0])        # PyTorch's gradient of an infeasible sequence is NaN; ours is 0
    torch.testing.assert_close(cpu[0], theirs[0], **TOL[dtype])
    torch.testing.assert_close(cpu[1][:, feasible], theirs[1][:, feasible], **TOL[dtype])

@settings(max_examples=10)
@given(case=ctc_cases())
def test_ctc_loss_through_the_emulated_cuda_kernel_equals_the_cpu_kernel(case):
    lp, y, il, tl, blank, dtype = case
    run = lambda b: _value_and_grad(lambda x: ctc.ctc_loss(x, y, il, tl, blank=blank, reduction='none', backend=b), lp)
    _agree(run('cuda'), run('cpu'), dtype)

@settings(max_examples=25)
@given(case=ctc_cases())
def test_ctc_entropy_cpu_equals_the_reference(case):
    lp, y, il, tl, blank, dtype = case
    run = lambda b: _value_and_grad(lambda x: ctc.alignment_entropy(x, y, il, tl, blank=blank, backend=b), lp)
    _agree(run('cpu'), run('reference'), dtype)

@st.composite
def transducer_cases(draw, extra=0):
    "logits (B, T, U+1, V + extra), targets without the blank, lengths with T_b >= 1 (and some U_b = 0)."
    B, T, U, V = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(0, 4)), draw(st.integers(2, 6))
    blank = draw(st.integers(0, V - 1))
    labels = [c for c in range(V) if c != blank]
    y = torch.tensor(draw(st.lists(st.lists(st.sampled_from(labels), min_size=U, max_size=U), min_size=B, max_size=B)),
                     dtype=torch.int32).reshape(B, U)
    il = torch.tensor(draw(st.lists(st.integers(1, T), min_size=B, max_size=B)), dtype=torch.int32)
    tl = torch.tensor(draw(st.lists(st.integers(0, U), min_size=B, max_size=B)), dtype=torch.int32)
    dtype, seed = draw(DTYPES), draw(st.integers(0, 2**16))
    x = torch.randn(B, T, U + 1, V + extra, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return x, y, il, tl, blank, dtype

@settings(max_examples=30)
@given(case=transducer_cases(), fused=st.booleans())
def test_rnnt_loss_cpu_equals_the_reference(case, fused):
    x, y, il, tl, blank, dtype = case
    if not fused: x = x.log_softmax(-1)
    run = lambda b: _value_and_grad(lambda z: rnnt.rnnt_loss(z, y, il, tl, blank=blank, reduction='none',
                                                             fused_log_softmax=fused, backend=b), x)
    _agree(run('cpu'), run('reference'), dtype)

@settings(max_examples=20)
@given(case=transducer_cases(extra=3))
def test_tdt_loss_cpu_equals_the_reference(case):
    x, y, il, tl, blank, dtype = case
    run = lambda b: _value_and_grad(lambda z: tdt.tdt_loss(z, y, il, tl, durations=(0, 1, 2), blank=blank,
                                                           reduction='none', backend=b), x)
    _agree(run('cpu'), run('reference'), dtype)

@settings(max_examples=20)
@given(T=st.integers(1, 8), N=st.integers(1, 3), L=st.integers(1, 5), dtype=DTYPES, seed=st.integers(0, 2**16),
       data=st.data())
def test_stay_move_logz_cpu_equals_the_reference(T, N, L, dtype, seed, data):
    g = torch.Generator().manual_seed(seed)
    stay, move = torch.randn(T, N, L, generator=g, dtype=dtype), torch.randn(T, N, L - 1, generator=g, dtype=dtype)
    tl = torch.tensor(data.draw(st.lists(st.integers(1, L), min_size=N, max_size=N)))
    def run(b):
        s, m = stay.clone().requires_grad_(), move.clone().requires_grad_()
        v = ctc_simple.logZ(s, m, tl, backend=b)
        torch.where(torch.isfinite(v), v, 0).sum().backward()
        return v.detach(), torch.cat([s.grad.flatten(), m.grad.flatten()])
    _agree(run('cpu'), run('reference'), dtype)

@settings(max_examples=15)
@given(T=st.integers(2, 10), N=st.integers(1, 3), state_len=st.integers(1, 3), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_crf_entropy_cpu_equals_the_reference(T, N, state_len, dtype, seed):
    crf = CTC_CRF(state_len=state_len, alphabet='NACGT')
    scores = torch.randn(T, N, crf.n_score(), generator=torch.Generator().manual_seed(seed), dtype=dtype)
    run = lambda b: _value_and_grad(lambda s: crf.entropy(s, backend=b), scores)
    _agree(run('cpu'), run('reference'), dtype)

@settings(max_examples=30)
@given(N=st.integers(0, 6), C=st.integers(1, 50), dtype=DTYPES, seed=st.integers(0, 2**16),
       smoothing=st.sampled_from([0.0, 0.1]), reduction=st.sampled_from(['none', 'sum', 'mean']), data=st.data())
def test_cross_entropy_equals_pytorch(N, C, dtype, seed, smoothing, reduction, data):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g, dtype=dtype)
    y = torch.tensor(data.draw(st.lists(st.sampled_from(list(range(C)) + [-100]), min_size=N, max_size=N)), dtype=torch.long)
    ours = _value_and_grad(lambda z: cross_entropy.cross_entropy(z, y, reduction=reduction, label_smoothing=smoothing), x)
    theirs = _value_and_grad(lambda z: F.cross_entropy(z, y, reduction=reduction, label_smoothing=smoothing), x)
    if reduction == 'mean' and not (y != -100).any():      # nothing to average: PyTorch's 0/0, our documented 0
        assert theirs[0].isnan() and ours[0].item() == 0.0 and not ours[1].any()
        return
    _agree(ours, theirs, dtype)
