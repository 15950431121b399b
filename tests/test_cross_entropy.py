"""cross_entropy, linear_cross_entropy and vocab_parallel_cross_entropy: against F.cross_entropy and the unfused
composition in float64 on randomised cases, the three backends (the CUDA kernels through the emulator) against each
other, gradcheck, autograd safety, torch.compile, bad inputs."""
import math, os, tempfile
import pytest, torch
import torch.nn as nn
import torch.nn.functional as F
import seqdist.cross_entropy as ce
import seqdist.benchmarks.cross_entropy as ce_benchmarks
from seqdist.cross_entropy import (cross_entropy, cross_entropy_reference, CrossEntropyLoss, linear_cross_entropy,
                                   LinearCrossEntropy, LinearCrossEntropyLoss, vocab_parallel_cross_entropy, softcap_logits)
from seqdist.utils import emulator_options
from seqdist.ops import launch_limits

def _close(a, b, rtol, atol=0.0):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= atol + rtol * max(1.0, b.abs().max().item() if b.numel() else 0.0), err

def _unfused(x, t, weight=None, ignore_index=-100, reduction='mean', label_smoothing=0.0, z_loss=0.0, softcap=None):
    "F.cross_entropy of the soft-capped logits plus the z-loss, written out (the definition being tested)."
    xc = softcap_logits(x, softcap)
    loss = F.cross_entropy(xc, t, weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    if z_loss:
        keep = t != ignore_index
        z = z_loss * torch.where(keep, xc.logsumexp(1 if x.dim() > 1 else 0), 0) ** 2
        loss = loss + (z if reduction == 'none' else z.sum() if reduction == 'sum' else z.sum() / keep.sum().clamp(min=1))
    return loss

def _random_case(g, i):
    "Case i of the randomised sweep: shape (with extra dims or unbatched), options and targets."
    kind = i % 4
    C = int(torch.randint(1, 40, (), generator=g))
    N = int(torch.randint(1, 9, (), generator=g))
    shape = {0: (N, C), 1: (N, C, int(torch.randint(1, 4, (), generator=g))), 2: (C,), 3: (N, C, 2, 3)}[kind]
    x = (3 * torch.randn(shape, generator=g, dtype=torch.float64))
    tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    t = torch.randint(0, C, tshape, generator=g)
    ii = 7 if i % 5 == 0 and C > 7 else -100              # a non-default ignore_index (one that is a class) now and then
    if i % 3 and t.numel():                               # ignored targets present in two cases out of three
        t = torch.where(torch.rand(tshape, generator=g) < 0.3, ii, t)
    opts = dict(reduction=('mean', 'sum', 'none')[i % 3], ignore_index=ii)
    if i % 2: opts['weight'] = torch.rand(C, generator=g, dtype=torch.float64) + 0.1
    if i % 5 in (1, 3): opts['label_smoothing'] = float(torch.rand((), generator=g))
    if i % 7 in (2, 5): opts['z_loss'] = 1e-2
    if i % 6 in (1, 4): opts['softcap'] = 2.0 + 3 * float(torch.rand((), generator=g))
    return x, t, opts

@pytest.mark.parametrize('backend', ['cpu', 'reference'])
def test_240_random_cases_against_pytorch_fp64(backend):
    "Values and gradients against F.cross_entropy (plus the written-out z-loss and soft-cap) on 240 random cases."
    g = torch.Generator().manual_seed(1)
    for i in range(240):
        x, t, opts = _random_case(g, i)
        if (t == opts['ignore_index']).all() and opts['reduction'] == 'mean':
            continue   # all ignored: PyTorch gives NaN, we give 0 (tested separately)
        grads = []
        for f in (_unfused, lambda *a, **k: cross_entropy(*a, backend=backend, **k)):
            xg = x.clone().requires_grad_()
            loss = f(xg, t, **opts)
            (loss * torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).reshape(loss.shape)).sum().backward()
            grads.append((loss.detach(), xg.grad))
        _close(grads[1][0], grads[0][0], 1e-12)
        _close(grads[1][1], grads[0][1], 1e-12)

@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_three_backends_agree(dtype, tol, monkeypatch):
    """reference, cpu and cuda (the CUDA source in the emulator; 64 threads per row so a row takes several loops
    and two warps; 3 blocks for 7 rows so the grid-stride loop runs) on irregular shapes with every option."""
    monkeypatch.setattr(ce, 'MAX_ROW_BLOCKS', 3)
    g = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(7, 181, generator=g)).to(dtype)
    t = torch.randint(0, 181, (7,), generator=g)
    t[2] = -100
    w = (torch.rand(181, generator=g) + 0.5).to(dtype)
    for opts in [dict(), dict(weight=w, label_smoothing=0.15), dict(z_loss=1e-3, softcap=6.0, reduction='none'),
                 dict(weight=w, label_smoothing=0.3, softcap=3.0, z_loss=0.01, reduction='sum')]:
        out = {}
        for backend in ('reference', 'cpu', 'cuda'):
            with emulator_options(seed=5), launch_limits(max_threads=64):
                xg = x.clone().requires_grad_()
                loss, lse = cross_entropy(xg, t, backend=backend, return_lse=True, **opts)
                (loss.sum() + 0.3 * lse.sum()).backward()
            out[backend] = loss.detach().double(), lse.detach().double(), xg.grad.double()
        for backend in ('cpu', 'cuda'):
            for a, b in zip(out[backend], out['reference']): _close(a, b, tol)

def test_gradcheck():
    torch.manual_seed(3)
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, -100, 8, 0])
    w = torch.rand(9, dtype=torch.float64) + 0.2
    for backend in ('cpu', 'cuda'):
        f = lambda x: cross_entropy(x, t, w, label_smoothing=0.2, z_loss=0.1, softcap=2.5, return_lse=True, backend=backend)
        assert torch.autograd.gradcheck(f, (x,))
        assert torch.autograd.gradcheck(lambda x: cross_entropy(x, t, reduction='none', backend=backend), (x,))

@launch_limits(max_threads=64)
def test_bf16_and_fp16_accumulate_in_fp32():
    "bf16/fp16 logits: the loss (float32) within 1e-3 relative of the float64 loss of the same values; bf16 in the emulated CUDA kernel too."
    g = torch.Generator().manual_seed(4)
    x = (2 * torch.randn(6, 300, generator=g))
    t = torch.randint(0, 300, (6,), generator=g)
    for dtype in (torch.bfloat16, torch.float16):
        xl = x.to(dtype)
        ref = F.cross_entropy(xl.double(), t)
        for backend in ('cpu', 'cuda'):
            xg = xl.clone().requires_grad_()
            loss = cross_entropy(xg, t, backend=backend, label_smoothing=0.1)
            loss.backward()
            assert loss.dtype == torch.float32 and xg.grad.dtype == dtype
            assert abs(loss.double() - F.cross_entropy(xl.double(), t, label_smoothing=0.1)) <= 1e-3 * abs(ref)
            xd = xl.double().requires_grad_()
            F.cross_entropy(xd, t, label_smoothing=0.1).backward()
            _close(xg.grad.double(), xd.grad, 1e-2)

def test_logits_used_twice_and_inputs_unmodified():
    "The logits feed two losses (retain_graph, two backward passes): gradients as eager PyTorch's; inputs untouched."
    torch.manual_seed(5)
    base = torch.randn(5, 11, dtype=torch.float64)
    t = torch.tensor([0, 3, -100, 10, 4])
    grads = []
    for f in (F.cross_entropy, cross_entropy):
        x = base.clone().requires_grad_()
        logits = x * 2
        l1 = f(logits, t)
        l2 = (logits.softmax(1) ** 2).sum() + f(logits, t, label_smoothing=0.1)
        l1.backward(retain_graph=True)
        (l1 + l2).backward()
        grads.append(x.grad.clone())
        assert torch.equal(x.detach(), base)
    _close(grads[1], grads[0], 1e-12)

def test_all_ignored_gives_zero_without_nan():
    for backend in ('cpu', 'cuda', 'reference'):
        x = torch.randn(3, 5, requires_grad=True)
        t = torch.full((3,), -100)
        loss = cross_entropy(x, t, weight=torch.rand(5), label_smoothing=0.1, z_loss=0.1, backend=backend)
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros(3, 5))

def test_non_contiguous_inputs_and_determinism():
    torch.manual_seed(6)
    xt = torch.randn(40, 6, dtype=torch.float64).T                  # (6, 40), not contiguous
    t = torch.randint(0, 40, (6,))
    grads = []
    for x in (xt, xt.contiguous()):
        for _ in range(2):
            xg = x.clone() if x.is_contiguous() else x.detach().T.clone().T
            xg.requires_grad_()
            loss = cross_entropy(xg, t, label_smoothing=0.1)
            loss.backward()
            grads.append((loss.detach(), xg.grad))
    for a, b in ((0, 1), (2, 3)):                                   # the same call twice: bit-identical
        assert torch.equal(grads[a][0], grads[b][0]) and torch.equal(grads[a][1], grads[b][1])
    _close(grads[0][0], grads[2][0], 1e-12)                        # strided vs contiguous rows: the same to rounding
    _close(grads[0][1], grads[2][1], 1e-12)

def test_probability_targets():
    torch.manual_seed(7)
    x = torch.randn(4, 6, 3, dtype=torch.float64, requires_grad=True)
    p = torch.randn(4, 6, 3, dtype=torch.float64).softmax(1)
    for kw in (dict(), dict(label_smoothing=0.2, reduction='sum'), dict(weight=torch.rand(6, dtype=torch.float64))):
        _close(cross_entropy(x, p, **kw), F.cross_entropy(x, p, **kw), 1e-12)

def test_module_and_compile():
    torch.manual_seed(8)
    x = torch.randn(6, 13, requires_grad=True)
    t = torch.tensor([1, 2, -100, 12, 0, 5])
    m = CrossEntropyLoss(weight=torch.rand(13), label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    eager = m(x, t)
    ge, = torch.autograd.grad(eager, x)
    compiled = torch.compile(lambda x, t: m(x, t), fullgraph=True)
    loss = compiled(x, t)
    gc, = torch.autograd.grad(loss, x)
    _close(loss.detach(), eager.detach(), 1e-6)
    _close(gc, ge, 1e-6)
    nn_loss = nn.CrossEntropyLoss(weight=m.weight, label_smoothing=0.1)(x, t)
    _close(CrossEntropyLoss(weight=m.weight, label_smoothing=0.1)(x, t).detach(), nn_loss.detach(), 1e-6)

BAD = [  # (args, kwargs, exception, part of the message)
    (lambda: (torch.randn(3, 5), torch.tensor([0, 5, 1])), {}, ValueError, 'target must hold class indices in [0, 5)'),
    (lambda: (torch.randn(3, 5), torch.tensor([0, -1, 1])), {}, ValueError, 'got [-1]'),
    (lambda: (torch.randn(3, 5), torch.tensor([0, 1])), {}, ValueError, 'target must have shape (3,)'),
    (lambda: (torch.randn(3, 5), torch.tensor([0., 1, 1])), {}, ValueError, 'probability targets must have the input'),
    (lambda: (torch.randn(3, 5), torch.tensor([True, False, True])), {}, TypeError, 'target must hold class indices'),
    (lambda: (torch.randint(0, 3, (3, 5)), torch.tensor([0, 1, 1])), {}, TypeError, 'input must be float16, bfloat16'),
    (lambda: (torch.randn(3, 5), torch.tensor([0, 1, 1])), dict(weight=torch.rand(4)), ValueError, 'weight must have shape (5,)'),
    (lambda: (torch.randn(3, 5), torch.tensor([0, 1, 1])), dict(weight=torch.ones(5, dtype=torch.long)), TypeError, 'weight must be a float tensor'),
    (lambda: (torch.randn(3, 5), torch.tensor([0, 1, 1])), dict(reduction='avg'), ValueError, "reduction must be 'none', 'sum' or 'mean'"),
    (lambda: (torch.randn(3, 5), torch.tensor([0, 1, 1])), dict(label_smoothing=1.5), ValueError, 'label_smoothing must be a float in [0, 1]'),
    (lambda: (torch.randn(3, 5), torch.tensor([0, 1, 1])), dict(z_loss=-1.0), ValueError, 'z_loss must be a finite float >= 0'),
    (lambda: (torch.randn(3, 5), torch.tensor([0, 1, 1])), dict(softcap=0.0), ValueError, 'softcap must be None or a float > 0'),
    (lambda: (torch.randn(3, 5), torch.tensor([0, 1, 1])), dict(backend='gpu'), ValueError, "backend must be 'auto'"),
    (lambda: (torch.randn(3, 0), torch.tensor([0, 1, 1])), {}, ValueError, 'at least one class'),
    (lambda: (torch.tensor(1.0), torch.tensor(0)), {}, ValueError, 'got a scalar'),
    (lambda: ([[1.0, 2.0]], torch.tensor([0])), {}, TypeError, 'input must be a tensor'),
]

@pytest.mark.parametrize('make,kwargs,exc,msg', BAD)
def test_bad_inputs(make, kwargs, exc, msg):
    with pytest.raises(exc) as e: cross_entropy(*make(), **kwargs)
    assert msg in str(e.value), str(e.value)

def _lin(**kw):
    "linear_cross_entropy's arguments: input (4, 8), linear_weight (10, 8), targets 0, with kw replacing any of them."
    return dict(dict(input=torch.randn(4, 8), linear_weight=torch.randn(10, 8), target=torch.zeros(4, dtype=torch.long)), **kw)

LINEAR_BAD = [
    (_lin(linear_weight=torch.randn(10, 7)), ValueError, 'input must have shape (..., 7)'),
    (_lin(target=torch.zeros(3, dtype=torch.long)), ValueError, 'target must have shape (4,)'),
    (_lin(linear_weight=torch.randn(10, 8).double()), TypeError, 'must have the same dtype'),
    (_lin(linear_bias=torch.randn(9)), ValueError, 'linear_bias must have shape (10,)'),
    (_lin(target=torch.full((4,), 10)), ValueError, 'class indices in [0, 10)'),
    (_lin(chunk_size=0), ValueError, 'chunk_size must be None or a positive int'),
    (_lin(weight=torch.rand(3)), ValueError, 'weight must have shape (10,)'),
    (_lin(ce_weight=torch.rand(3)), ValueError, 'weight must have shape (10,)'),
    (_lin(weight=torch.randn(10, 8)), ValueError, 'the projection is linear_weight'),
    (_lin(bias=torch.randn(10), linear_bias=torch.randn(10)), TypeError, 'pass linear_bias= or its earlier name bias='),
    (_lin(weight=torch.rand(10), ce_weight=torch.rand(10)), TypeError, 'pass weight= or its earlier name ce_weight='),
    (_lin(linear_weight=torch.randn(10)), ValueError, 'linear_weight must have shape (C, in_features)'),
    (_lin(input=torch.randn(2, 4, 8), linear_weight=torch.randn(10, 3, 8), target=torch.zeros(2, 4, 3, dtype=torch.long)),
     ValueError, 'K-dimensional loss'),
    (_lin(linear_weight=torch.randn(10, 3, 8), target=torch.zeros(4, dtype=torch.long)), ValueError, 'target must have shape (4, 3)'),
    (_lin(target=torch.rand(4, 10), ignore_index=-100), ValueError, 'ignore_index cannot be given with probability targets'),
    (_lin(target=torch.rand(4, 9)), ValueError, "probability targets must have the logits' shape (4, 10)"),
    (_lin(options='chunked'), TypeError, 'options must be None or a torch.nn.LinearCrossEntropyOptions'),
    (_lin(ignore_index=1.5), TypeError, 'ignore_index must be an int'),
    (_lin(reduction='avg'), ValueError, "reduction must be 'none', 'sum' or 'mean'"),
    (_lin(input=[[1.0] * 8]), TypeError, 'input must be a tensor'),
]
if hasattr(nn, 'LinearCrossEntropyOptions'):
    LINEAR_BAD.append((_lin(options=nn.LinearCrossEntropyOptions(batch_chunk_size=2), chunk_size=3), ValueError,
                       'chunk_size=3 and options.batch_chunk_size=2 disagree'))

def test_linear_old_positional_arguments_are_a_type_error():
    "seqdist's earlier positional bias (4th argument) is keyword-only now, as in PyTorch: Python's own TypeError says so."
    with pytest.raises(TypeError, match='positional'):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), torch.randn(10))

@pytest.mark.parametrize('kwargs,exc,msg', LINEAR_BAD)
def test_linear_bad_inputs(kwargs, exc, msg):
    with pytest.raises(exc) as e: linear_cross_entropy(**kwargs)
    assert msg in str(e.value), str(e.value)

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
@launch_limits(max_threads=32)
def test_linear_cross_entropy_equals_the_unfused_composition(backend):
    "Every option and reduction, with and without bias, extra dims, chunks that do not divide N: loss and the three gradients."
    g = torch.Generator().manual_seed(9)
    h = torch.randn(3, 7, 16, generator=g, dtype=torch.float64)
    W = torch.randn(45, 16, generator=g, dtype=torch.float64) / 3
    b = torch.randn(45, generator=g, dtype=torch.float64)
    t = torch.randint(0, 45, (3, 7), generator=g)
    t[1, 2] = -100
    cw = torch.rand(45, generator=g, dtype=torch.float64) + 0.1
    cases = [(dict(), True, None), (dict(label_smoothing=0.2, z_loss=1e-2, softcap=3.0), True, 5),
             (dict(reduction='none', ce_weight=cw, z_loss=0.1), False, 4), (dict(reduction='sum', ce_weight=cw, label_smoothing=0.1), True, 21)]
    for opts, bias, chunk in cases:
        ref_opts = {('weight' if k == 'ce_weight' else k): v for k, v in opts.items()}
        out = []
        for f in (lambda h, W, b: cross_entropy_reference(F.linear(h, W, b).movedim(-1, 1), t, **ref_opts),
                  lambda h, W, b: linear_cross_entropy(h, W, t, linear_bias=b, chunk_size=chunk, backend=backend, **opts)):
            args = [a.clone().requires_grad_() for a in (h, W, b if bias else None) if a is not None]
            loss = f(*args) if bias else f(*args, None)
            grads = torch.autograd.grad((loss * 1.5).sum(), args)
            out.append((loss.detach(),) + grads)
        for a, r in zip(out[1], out[0]): _close(a, r, 1e-12)

def test_linear_module_state_dict_twice_used_hidden_and_compile():
    torch.manual_seed(10)
    head = LinearCrossEntropy(16, 30, label_smoothing=0.1)
    lin = nn.Linear(16, 30)
    lin.load_state_dict(head.state_dict())
    assert set(head.state_dict()) == {'weight', 'bias'}
    x = torch.randn(9, 16, requires_grad=True)
    t = torch.randint(0, 30, (9,))
    grads = []
    for loss_fn in (lambda h: F.cross_entropy(lin(h), t, label_smoothing=0.1), lambda h: head(h, t)):
        h = x * 1.0
        l1 = loss_fn(h)
        l1.backward(retain_graph=True)                     # the hidden states feed a second loss, two backward passes
        (loss_fn(h) + (h ** 2).sum() + l1).backward()
        grads.append(x.grad.clone()); x.grad = None
    _close(grads[1], grads[0], 1e-5)
    compiled = torch.compile(lambda h, t: head(h, t), fullgraph=True)
    l_e, l_c = head(x, t), compiled(x, t)
    _close(l_c.detach(), l_e.detach(), 1e-6)
    _close(torch.autograd.grad(l_c, x)[0], torch.autograd.grad(l_e, x)[0], 1e-6)
    _close(torch.autograd.grad(compiled(x, t) * 3, head.weight)[0], torch.autograd.grad(head(x, t) * 3, head.weight)[0], 1e-6)

def test_linear_bf16_close_to_fp64():
    g = torch.Generator().manual_seed(11)
    h, W = torch.randn(20, 32, generator=g), torch.randn(100, 32, generator=g) / 6
    t = torch.randint(0, 100, (20,), generator=g)
    hb, Wb = h.bfloat16().requires_grad_(), W.bfloat16().requires_grad_()
    loss = linear_cross_entropy(hb, Wb, t, chunk_size=7)
    loss.backward()
    ref = F.cross_entropy(hb.double() @ Wb.double().T, t)
    assert loss.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16 and Wb.grad.dtype == torch.bfloat16
    assert abs(loss.double() - ref).item() <= 1e-3 * ref.item()

HAS_TORCH_LCE = hasattr(F, 'linear_cross_entropy') and hasattr(nn, 'LinearCrossEntropyOptions')
needs_torch_lce = pytest.mark.skipif(not HAS_TORCH_LCE, reason='torch.nn.functional.linear_cross_entropy is PyTorch >= 2.13')

def _random_linear_case(g, i):
    """Case i of the sweep against F.linear_cross_entropy: shape kind (batched, unbatched, K-dim with one and two
    extra dims), class-index or probability targets, and every keyword of PyTorch's signature."""
    kind = i % 4
    H, C, N = int(torch.randint(1, 12, (), generator=g)), int(torch.randint(1, 30, (), generator=g)), int(torch.randint(1, 9, (), generator=g))
    out = {0: (), 1: (), 2: (int(torch.randint(1, 4, (), generator=g)),), 3: (2, 3)}[kind]
    x = torch.randn((H,) if kind == 1 else (N, H), generator=g, dtype=torch.float64)
    W = torch.randn((C,) + out + (H,), generator=g, dtype=torch.float64) / 2
    b = torch.randn((C,) + out, generator=g, dtype=torch.float64) if i % 2 else None
    batch = () if kind == 1 else (N,)
    probs = i % 5 == 4
    kw = dict(reduction=('mean', 'sum', 'none')[i % 3], label_smoothing=(0.0, 0.15)[(i // 3) % 2])
    if (i // 2) % 3: kw['weight'] = torch.rand(C, generator=g, dtype=torch.float64) + 0.1
    if probs:
        t = torch.randn(batch + (C,) + out, generator=g, dtype=torch.float64).softmax(len(batch))
    else:
        t = torch.randint(0, C, batch + out, generator=g)
        ii = (None, -100, 3 if C > 3 else None)[(i // 5) % 3]
        if ii is not None: kw['ignore_index'] = ii
        if i % 7 and t.numel():
            t = torch.where(torch.rand(t.shape, generator=g) < 0.3, -100 if ii is None else ii, t)
    return x, W, b, t, kw

def _value_and_grads(f, x, W, b, g):
    args = [a.clone().requires_grad_() for a in (x, W, b) if a is not None]
    loss = f(*args) if b is not None else f(*args, None)
    r = torch.rand(loss.shape, generator=g, dtype=loss.dtype) + 0.5          # a random upstream gradient
    return (loss.detach(),) + torch.autograd.grad((loss * r).sum(), args)

@needs_torch_lce
@pytest.mark.parametrize('torch_path', ['reference', 'chunked'])
@launch_limits(max_threads=32)
def test_linear_120_random_cases_against_pytorch_fp64(torch_path):
    """Ours equals F.linear_cross_entropy (options=None, and its chunked path options=LinearCrossEntropyOptions(),
    which falls back to its reference with a warning where it cannot chunk) in float64: loss and the gradients of input,
    linear_weight and linear_bias, over every argument; ours on each backend, given the same options."""
    import warnings
    g = torch.Generator().manual_seed(21)
    options = None if torch_path == 'reference' else nn.LinearCrossEntropyOptions()
    nan_means = 0
    for i in range(120):
        x, W, b, t, kw = _random_linear_case(g, i)
        backend = ('cpu', 'reference', 'cuda')[(i // 4) % 3]
        chunk = (None, 1, 3)[(i // 6) % 3]
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            ref = _value_and_grads(lambda x, W, b: F.linear_cross_entropy(x, W, t, linear_bias=b, options=options, **kw), x, W, b, torch.Generator().manual_seed(i))
        ours = _value_and_grads(lambda x, W, b: linear_cross_entropy(x, W, t, linear_bias=b, options=options, chunk_size=chunk,
                                                                      backend=backend, **kw), x, W, b, torch.Generator().manual_seed(i))
        if kw['reduction'] == 'mean' and not t.is_floating_point() and (t == kw.get('ignore_index', -100)).all():
            assert torch.isnan(ref[0]) and ours[0].item() == 0.0        # all ignored: PyTorch's 0/0, our documented 0
            nan_means += 1
            continue
        for a, r in zip(ours, ref): _close(a, r, 1e-10)
    assert nan_means < 10

@needs_torch_lce
def test_linear_options_and_ignore_index_none():
    "options' batch_chunk_size is our chunk size (same result); ignore_index=None is -100; the old keywords still work."
    g = torch.Generator().manual_seed(22)
    x, W, b = torch.randn(11, 6, generator=g, dtype=torch.float64), torch.randn(9, 6, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)
    t = torch.randint(0, 9, (11,), generator=g); t[2] = -100
    cw = torch.rand(9, generator=g, dtype=torch.float64)
    base = linear_cross_entropy(x, W, t, linear_bias=b, weight=cw)
    for kw in [dict(options=nn.LinearCrossEntropyOptions(batch_chunk_size=4)), dict(ignore_index=-100),
               dict(options=nn.LinearCrossEntropyOptions(acc_policy='compact', allow_retain_graph=True), chunk_size=2)]:
        _close(linear_cross_entropy(x, W, t, linear_bias=b, weight=cw, **kw), base, 1e-13)
    _close(linear_cross_entropy(x, W, t, bias=b, ce_weight=cw), base, 0)            # seqdist's earlier keywords
    _close(F.linear_cross_entropy(x, W, t, linear_bias=b, weight=cw), base, 1e-13)

def _z_reference(x, t, z_loss, reduction, ignore_index=-100):
    "The z-loss term written out: z_loss * lse**2 of the rows not ignored, reduced as the loss ('mean': over those rows)."
    keep = t != ignore_index if not t.is_floating_point() else torch.ones(x.shape[:1], dtype=torch.bool)
    z = z_loss * torch.where(keep, x.logsumexp(1), 0) ** 2
    return z if reduction == 'none' else z.sum() if reduction == 'sum' else z.sum() / keep.sum().clamp(min=1)

@pytest.mark.parametrize('backend', ['cpu', 'reference'])
def test_return_z_loss(backend):
    """return_z_loss=True returns (loss, z_loss) as Liger-Kernel's: loss as without it (the z-term included), z_loss
    the term alone reduced like the loss over the rows not ignored; (loss, z_loss, lse) with return_lse too. Both
    functions, every reduction, class-index and probability targets."""
    g = torch.Generator().manual_seed(23)
    x = torch.randn(7, 6, generator=g, dtype=torch.float64)
    W = torch.randn(13, 6, generator=g, dtype=torch.float64)
    logits = x @ W.T
    t = torch.randint(0, 13, (7,), generator=g); t[[1, 4]] = -100
    p = torch.rand(7, 13, generator=g, dtype=torch.float64).softmax(1)
    for reduction in ('mean', 'sum', 'none'):
        for target in (t, p):
            kw = dict(reduction=reduction, z_loss=0.03, label_smoothing=0.1, backend=backend)
            z_ref = _z_reference(logits, target, 0.03, reduction)
            for fn, args in ((cross_entropy, (logits, target)), (linear_cross_entropy, (x, W, target))):
                loss, z = fn(*args, return_z_loss=True, **kw)
                _close(loss, fn(*args, **kw), 1e-13)
                _close(z, z_ref, 1e-12)
                assert not z.requires_grad
                loss3, z3, lse = fn(*args, return_z_loss=True, return_lse=True, **kw)
                _close(z3, z_ref, 1e-12); _close(lse.detach(), logits.logsumexp(1), 1e-12)
            _close(cross_entropy(logits, target, return_z_loss=True, **dict(kw, z_loss=0.0))[1], torch.zeros_like(z_ref), 0)
    loss, z = CrossEntropyLoss(z_loss=0.03, return_z_loss=True)(logits, t)
    _close(z, _z_reference(logits, t, 0.03, 'mean'), 1e-12)

@needs_torch_lce
def test_linear_loss_module_matches_pytorchs():
    """LinearCrossEntropyLoss has nn.LinearCrossEntropyLoss's constructor and state_dict: each loads the other's
    weights and gives the same loss and gradients (K-dim with bias and class weights, and the plain head)."""
    for kw in [dict(out_features=(3,), bias=True, weight=torch.rand(7, dtype=torch.float64), label_smoothing=0.1),
               dict(reduction='sum', ignore_index=2, options=nn.LinearCrossEntropyOptions())]:
        torch.manual_seed(24)
        theirs = nn.LinearCrossEntropyLoss(5, 7, dtype=torch.float64, **kw)
        ours = LinearCrossEntropyLoss(5, 7, dtype=torch.float64, **kw)
        assert list(ours.state_dict()) == list(theirs.state_dict())
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(6, 5, dtype=torch.float64)
        t = torch.randint(0, 7, (6,) + kw.get('out_features', ()))
        res = []
        for m in (theirs, ours):
            loss = m(x, t)
            res.append([loss.detach()] + list(torch.autograd.grad(loss, list(m.linear.parameters()))))
        for a, r in zip(res[1], res[0]): _close(a, r, 1e-12)
        theirs.load_state_dict(ours.state_dict())

def _vocab_parallel_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    g = torch.Generator().manual_seed(12)
    x = 3 * torch.randn(6, 2, 20, generator=g, dtype=torch.float64)      # (N, d, V): V = 20 split in 2 x 10
    t = torch.randint(0, 20, (6, 2), generator=g)
    t[0, 1] = -100
    res = {}
    for name, opts in [('plain', dict()), ('all', dict(label_smoothing=0.2, z_loss=0.05, softcap=4.0)),
                       ('none', dict(reduction='none', z_loss=0.1)), ('sum', dict(reduction='sum', label_smoothing=0.1))]:
        xl = x[..., rank * 10:(rank + 1) * 10].clone().requires_grad_()
        loss, lse = vocab_parallel_cross_entropy(xl, t, return_lse=True, **opts)
        (loss * 1.5).sum().backward()
        res[name] = (loss.detach(), lse.detach(), xl.grad)
    torch.save(res, os.path.join(out_dir, f'rank{rank}.pt'))
    dist.destroy_process_group()

def test_vocab_parallel_two_gloo_processes():
    "Two CPU processes (gloo) each holding half of the vocabulary give the single-process loss, lse and gradient."
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_vocab_parallel_worker, args=(2, os.path.join(d, 'init'), d), nprocs=2, join=True)
        res = [torch.load(os.path.join(d, f'rank{r}.pt')) for r in range(2)]
    g = torch.Generator().manual_seed(12)
    x = 3 * torch.randn(6, 2, 20, generator=g, dtype=torch.float64)
    t = torch.randint(0, 20, (6, 2), generator=g)
    t[0, 1] = -100
    for name, opts in [('plain', dict()), ('all', dict(label_smoothing=0.2, z_loss=0.05, softcap=4.0)),
                       ('none', dict(reduction='none', z_loss=0.1)), ('sum', dict(reduction='sum', label_smoothing=0.1))]:
        xg = x.clone().requires_grad_()
        loss, lse = cross_entropy_reference(xg.movedim(-1, 1), t, return_lse=True, **opts)
        (loss * 1.5).sum().backward()
        for r in range(2):
            _close(res[r][name][0], loss.detach(), 1e-12)
            _close(res[r][name][1], lse.detach(), 1e-12)
            _close(res[r][name][2], xg.grad[..., r * 10:(r + 1) * 10], 1e-12)

def test_vocab_parallel_needs_a_process_group():
    with pytest.raises(RuntimeError, match='process group'):
        vocab_parallel_cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]))

def test_bench_quick_rows():
    rows = ce_benchmarks.bench_cross_entropy(quick=True)
    linear = ['linear_cross_entropy fwd+bwd'] * (2 if hasattr(F, 'linear_cross_entropy') else 1)
    assert [r['op'] for r in rows] == ['cross_entropy fwd+bwd'] + linear + ['linear_token_stats fwd+bwd'] * 3
    assert all(set(r) == {'op', 'shape', 'anchor', 'anchor_ms', 'ours_ms', 'ratio', 'check'} and r['ours_ms'] > 0 for r in rows)

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_inplace_backward(backend):
    "The opt-in in-place mode: the same gradient; a clear error when autograd still needs the logits; no leaf logits."
    torch.manual_seed(13)
    h, W = torch.randn(6, 8, dtype=torch.float64), torch.randn(20, 8, dtype=torch.float64)
    t = torch.tensor([1, 19, -100, 0, 7, 3])
    grads = []
    for inplace in (False, True):
        hg = h.clone().requires_grad_()
        loss = cross_entropy(hg @ W.T, t, label_smoothing=0.1, z_loss=1e-2, softcap=3.0, inplace_backward=inplace, backend=backend)
        loss.backward()
        grads.append(hg.grad)
    _close(grads[1], grads[0], 1e-12)
    two_uses = []
    for inplace in (False, True):      # the pow node is newer: its backward runs first and has used the logits
        hg = h.clone().requires_grad_()
        logits = hg @ W.T
        (cross_entropy(logits, t, inplace_backward=inplace, backend=backend) + (logits ** 2).sum()).backward()
        two_uses.append(hg.grad)
    _close(two_uses[1], two_uses[0], 1e-12)
    hg = h.clone().requires_grad_()
    logits = hg @ W.T                  # here the loss's backward runs first, while pow still needs the logits
    total = (logits ** 2).sum() + cross_entropy(logits, t, inplace_backward=True, backend=backend)
    with pytest.raises(RuntimeError, match='modified by an inplace operation'): total.backward()
    logits = hg @ W.T
    loss = cross_entropy(logits, t, inplace_backward=True, backend=backend)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match='modified by an inplace operation'): loss.backward()
    with pytest.raises(ValueError, match='not a leaf tensor'):
        cross_entropy(torch.randn(3, 4, requires_grad=True), torch.tensor([0, 1, 2]), inplace_backward=True)

def test_edge_shapes():
    "No rows, one class, one row, unbatched (C,), a 1-element batch on every backend; the emulated kernel at C < block."
    for backend in ('cpu', 'cuda', 'reference'):
        x = torch.randn(0, 5, dtype=torch.float64, requires_grad=True)
        for red in ('mean', 'sum'):
            loss = cross_entropy(x, torch.zeros(0, dtype=torch.long), reduction=red, backend=backend)
            loss.backward()
            assert loss.item() == 0.0 and x.grad.shape == (0, 5)
        assert cross_entropy(x, torch.zeros(0, dtype=torch.long), reduction='none', backend=backend).shape == (0,)
        x1 = torch.randn(3, 1, dtype=torch.float64, requires_grad=True)
        loss = cross_entropy(x1, torch.zeros(3, dtype=torch.long), label_smoothing=0.3, backend=backend)
        loss.backward()
        assert abs(loss.item()) < 1e-12 and x1.grad.abs().max() < 1e-12
        for x, t in [(torch.randn(1, 7, dtype=torch.float64), torch.tensor([6])), (torch.randn(7, dtype=torch.float64), torch.tensor(2))]:
            for red in ('mean', 'none'):
                _close(cross_entropy(x, t, reduction=red, backend=backend), F.cross_entropy(x, t, reduction=red), 1e-12)

def test_one_launch_forward_one_backward(monkeypatch):
    "The CUDA path (emulated) launches one kernel for the forward and one for the backward, whatever the options."
    calls = []
    kernels = {name: k for name, k in ce._ce_kernels[torch.float64].items()}
    def counting(name):
        def launch(*args, **kwargs):
            calls.append(name)
            return kernels[name](*args, **kwargs)
        return launch
    monkeypatch.setitem(ce._ce_kernels, torch.float64, {name: counting(name) for name in kernels})
    x = torch.randn(5, 40, dtype=torch.float64, requires_grad=True)
    loss = cross_entropy(x, torch.tensor([0, 1, -100, 3, 39]), torch.rand(40, dtype=torch.float64), label_smoothing=0.1,
                         z_loss=0.1, softcap=3.0, backend='cuda')
    assert calls == ['ce_forward']
    loss.backward()
    assert calls == ['ce_forward', 'ce_backward']

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_logits_modified_in_place_after_the_forward_raise(backend):
    "As for F.cross_entropy: logits modified in place between the forward and the backward are an error, not a wrong gradient."
    h, W = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8)
    logits = h @ W.T
    loss = cross_entropy(logits, torch.tensor([1, 2, 3, 4]), backend=backend)
    logits.mul_(2)
    with pytest.raises(RuntimeError, match='modified by an inplace operation'): loss.backward()

def test_linear_compile_without_bias():
    torch.manual_seed(25)
    x, W, t = torch.randn(9, 16, requires_grad=True), torch.randn(30, 16, requires_grad=True), torch.randint(0, 30, (9,))
    def f(x, W): return linear_cross_entropy(x, W, t)
    compiled = torch.compile(f, fullgraph=True, backend='aot_eager')
    ge, gc = (torch.autograd.grad(g(x, W), [x, W]) for g in (f, compiled))
    for a, b in zip(gc, ge): _close(a, b, 1e-6)

def _weighted_composition(x, t, w, reduction, eps, cap, ignore_index=-100):
    "log_softmax, then the weighted gather and smoothing term, written out: differentiable in the class weights too."
    xx = x if cap is None else cap * torch.tanh(x / cap)
    lp = xx.log_softmax(1)
    keep = t != ignore_index
    ti = torch.where(keep, t, 0)
    row = (1 - eps) * w[ti] * -lp.gather(1, ti[:, None])[:, 0] + eps / x.shape[1] * -(lp * w).sum(1)
    row = torch.where(keep, row, 0)
    if reduction == 'none': return row
    return row.sum() if reduction == 'sum' else row.sum() / torch.where(keep, w[ti], 0).sum()

@pytest.mark.parametrize('reduction', ['mean', 'sum', 'none'])
@pytest.mark.parametrize('eps, cap', [(0.0, None), (0.1, None), (0.0, 5.0), (0.2, 3.0)])
@pytest.mark.parametrize('backend', ['cpu', 'reference', 'cuda'])
def test_class_weights_that_require_grad_get_the_composition_s_gradient(reduction, eps, cap, backend):
    """Class weights are differentiable, as in the composition log_softmax -> weighted gather (PyTorch's own
    F.cross_entropy refuses a weight that requires grad): the rows' weighted losses and the 'mean' denominator both
    depend on them. (Once, only the denominator's part reached the weights: -1.09 where the composition gives 0.34.)"""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 6, (9,), generator=g); t[4] = -100
    w = torch.rand(6, generator=g, dtype=torch.float64).add(0.1).requires_grad_()
    want = _weighted_composition(x, t, w, reduction, eps, cap)
    got = ce.cross_entropy(x, t, w, reduction=reduction, label_smoothing=eps, softcap=cap, backend=backend)
    gw, gx = torch.autograd.grad(want.sum(), (w, x)), None
    gw_got = torch.autograd.grad(got.sum(), (w, x))
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(gw_got[0], gw[0], rtol=1e-10, atol=1e-12) and torch.allclose(gw_got[1], gw[1], rtol=1e-10, atol=1e-12)

def test_class_weight_gradcheck():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 3, -100, 1, 1])
    w = torch.rand(4, generator=g, dtype=torch.float64).add(0.1).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: ce.cross_entropy(x, t, w, label_smoothing=0.1, softcap=4.0), (x, w))

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_an_infinite_softcap_is_no_cap(backend):
    "softcap=inf caps nothing (inf * tanh(x / inf) would be inf * 0 = NaN): the loss and gradient of softcap=None."
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (6,), generator=g)
    got, want = (ce.cross_entropy(x, t, softcap=s, backend=backend) for s in (math.inf, None))
    assert torch.equal(got, want)
    assert torch.equal(*(torch.autograd.grad(v, x)[0] for v in (got, want)))
    h, w = torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(7, 3, generator=g, dtype=torch.float64)
    assert torch.equal(ce.linear_cross_entropy(h, w, t, softcap=math.inf), ce.linear_cross_entropy(h, w, t))

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
@pytest.mark.parametrize('chunk_size', [6, 10, None])
@pytest.mark.parametrize('kdim', [False, True])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_linear_half_precision_gemms_match_eager(dtype, kdim, chunk_size, backend, monkeypatch):
    """With every GEMM in half precision (the GPU's path, `_HALF_GEMMS`; forced here on the CPU; 'cuda' is the
    emulated kernel): the loss and gradients of eager PyTorch in that dtype (its own GEMMs, float32 loss), within its
    rounding, with a bias, with and without a K-dim target. The logits are the GEMM's half-precision output turned in
    place into their gradient; dW is one product a group of rows in the weight's dtype when there are at most
    LCE_HALF_DW_GROUPS groups (chunks of 10 rows: 2; the default: 1), else added a block of classes at a time into
    float32 (chunks of 6: 4 groups, blocks of 7 classes that do not divide C)."""
    import seqdist.cross_entropy as ce
    monkeypatch.setattr(ce, '_HALF_GEMMS', {'cpu'}); monkeypatch.setattr(ce, 'LCE_DW_BLOCK', 7)
    g = torch.Generator().manual_seed(12)
    D = 2 if kdim else 1
    h, W, b = torch.randn(20, 32, generator=g), torch.randn(30, D, 32, generator=g) / 6, torch.randn(30, D, generator=g) / 4
    t = torch.randint(0, 30, (20, D), generator=g); t[3] = -100
    if not kdim: W, b, t = W[:, 0], b[:, 0], t[:, 0]
    hb, Wb, bb = (x.to(dtype).requires_grad_() for x in (h, W, b))
    ours = linear_cross_entropy(hb, Wb, t, linear_bias=bb, chunk_size=chunk_size, backend=backend)
    g_ours = torch.autograd.grad(ours, (hb, Wb, bb))
    ref = F.cross_entropy(F.linear(hb, Wb.reshape(30 * D, 32), bb.reshape(-1)).view(20, 30, D).squeeze(2).float(), t)
    g_ref = torch.autograd.grad(ref, (hb, Wb, bb))
    assert ours.dtype == torch.float32 and all(x.dtype == dtype for x in g_ours)
    torch.testing.assert_close(ours, ref, rtol=2e-3, atol=2e-3)
    for a, r in zip(g_ours, g_ref): torch.testing.assert_close(a.float(), r.float(), rtol=2e-2, atol=2e-3)
