"""linear_token_stats: against its plain-PyTorch reference in float64 (1e-10) and float32 (1e-5) on randomised cases,
both chunked paths (numba rows, PyTorch rows), gradcheck of a weighted combination of both outputs, ignored targets,
bad inputs, inputs left unmodified, torch.compile."""
import pytest, torch
import torch.nn.functional as F
from seqdist.cross_entropy import linear_token_stats, linear_token_stats_reference

def _close(a, b, rtol):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= rtol * max(1.0, b.abs().max().item() if b.numel() else 0.0), err

def _case(i, dtype=torch.float64):
    "Case i: batch shape ((N,), (B, T), or (N,) with N = 1), V, H, options, a chunk size that need not divide N."
    g = torch.Generator().manual_seed(100 + i)
    V, H = int(torch.randint(1, 70, (), generator=g)), int(torch.randint(1, 20, (), generator=g))
    batch = [(int(torch.randint(1, 30, (), generator=g)),), (int(torch.randint(1, 5, (), generator=g)), 3), (1,)][i % 3]
    h = torch.randn(*batch, H, generator=g, dtype=torch.float64)
    W = 2 * torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) if i % 2 else None
    ii = 3 if i % 5 == 0 and V > 3 else -100                 # now and then an ignore_index that is a class
    t = torch.randint(0, V, batch, generator=g)
    if i % 4: t = torch.where(torch.rand(batch, generator=g) < 0.3, ii, t)
    opts = dict(ignore_index=ii, chunk_size=(None, 1, 4, 7)[i % 4])
    if i % 3 == 1: opts['temperature'] = 0.3 + 1.5 * float(torch.rand((), generator=g))
    if i % 7 in (2, 4, 6): opts['softcap'] = 1.0 + 4 * float(torch.rand((), generator=g))
    ga, gb = torch.randn(batch, generator=g, dtype=torch.float64), torch.randn(batch, generator=g, dtype=torch.float64)
    return [x.to(dtype) if x is not None else None for x in (h, W, b, ga, gb)], t, opts

def _run(f, h, W, b, t, ga, gb, **opts):
    "Both outputs and the gradients of sum(ga * log_probs + gb * entropy) with respect to h, W (and b)."
    args = [x.clone().requires_grad_() for x in (h, W) + ((b,) if b is not None else ())]
    lp, ent = f(args[0], args[1], t, linear_bias=args[2] if b is not None else None, **opts)
    grads = torch.autograd.grad((ga * lp).sum() + (gb * ent).sum(), args)
    return [lp.detach(), ent.detach(), *grads]

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
@pytest.mark.parametrize('dtype, tol', [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_60_random_cases_against_the_reference(backend, dtype, tol):
    for i in range(60):
        (h, W, b, ga, gb), t, opts = _case(i, dtype)
        ref_opts = {k: v for k, v in opts.items() if k != 'chunk_size'}
        ref = _run(linear_token_stats_reference, *(x.double() if x is not None else None for x in (h, W, b)), t,
                   ga.double(), gb.double(), **ref_opts)
        ours = _run(lambda *a, **k: linear_token_stats(*a, backend=backend, **k), h, W, b, t, ga, gb, **opts)
        assert all(o.dtype == dtype for o in ours), [o.dtype for o in ours]
        for o, r in zip(ours, ref): _close(o.double(), r, tol)

def test_reference_equals_log_softmax_and_a_brute_force_entropy():
    g = torch.Generator().manual_seed(1)
    h, W, b = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((5, 4), (9, 4), (9,)))
    t = torch.tensor([0, 8, -100, 3, 3])
    lp, ent = linear_token_stats_reference(h, W, t, linear_bias=b, temperature=0.5, softcap=2.0)
    z = 2.0 * torch.tanh((h @ W.T + b) / 2.0) / 0.5
    for i in range(5):
        p = [float(torch.exp(z[i, v]) / torch.exp(z[i]).sum()) for v in range(9)]
        if t[i] == -100: assert lp[i] == 0 and ent[i] == 0; continue
        assert abs(lp[i].item() - torch.log(torch.tensor(p[t[i]], dtype=torch.float64)).item()) < 1e-12
        assert abs(ent[i].item() - sum(-q * torch.log(torch.tensor(q, dtype=torch.float64)).item() for q in p)) < 1e-12

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_gradcheck_weighted_combination(backend):
    g = torch.Generator().manual_seed(2)
    h, W, b = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((5, 3), (7, 3), (7,)))
    t = torch.tensor([0, 6, -100, 2, 2])
    wa, wb = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    for opts in (dict(), dict(temperature=0.6, softcap=1.5)):
        def f(h, W, b):
            lp, ent = linear_token_stats(h, W, t, linear_bias=b, chunk_size=2, backend=backend, **opts)
            return (wa * lp).sum() + (wb * ent).sum()
        assert torch.autograd.gradcheck(f, (h, W, b))
        assert torch.autograd.gradcheck(lambda h, W, b: linear_token_stats(h, W, t, linear_bias=b, backend=backend, **opts), (h, W, b))

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_op_log_normaliser_is_logsumexp_and_differentiable(backend):
    "The op's third output (what the sharded call builds on): logsumexp of the logits, gradchecked with the other two."
    from seqdist.cross_entropy import linear_token_stats_op
    g = torch.Generator().manual_seed(5)
    h, W, b = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((5, 3), (7, 3), (7,)))
    t = torch.tensor([0, 6, -100, 2, 2])
    wa, wb, wc = (torch.randn(5, generator=g, dtype=torch.float64) for _ in range(3))
    for T, cap in ((1.0, 0.0), (0.6, 1.5)):
        lse = linear_token_stats_op(h, W, b, t, -100, T, cap, 2, backend=backend)[2]
        z = (cap * torch.tanh((h @ W.T + b) / cap) if cap else h @ W.T + b) / T
        keep = t != -100
        assert (lse[keep] - z.logsumexp(-1)[keep]).abs().max() < 1e-12
        def f(h, W, b):
            lp, ent, lse = linear_token_stats_op(h, W, b, t, -100, T, cap, 2, backend=backend)
            return (wa * lp).sum() + (wb * ent).sum() + (wc * torch.where(keep, lse, 0)).sum()
        assert torch.autograd.gradcheck(f, (h, W, b))

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_ignored_rows_give_zero_and_no_gradient_and_inputs_unmodified(backend):
    g = torch.Generator().manual_seed(3)
    h, W, b = (torch.randn(s, generator=g) for s in ((6, 8), (40, 8), (40,)))
    t = torch.tensor([-100, 5, -100, 39, 0, -100])
    copies = [x.clone() for x in (h, W, b, t)]
    hg, Wg, bg = (x.clone().requires_grad_() for x in (h, W, b))
    lp, ent = linear_token_stats(hg, Wg, t, linear_bias=bg, softcap=3.0, chunk_size=4, backend=backend)
    ign = t == -100
    assert (lp[ign] == 0).all() and (ent[ign] == 0).all() and (ent[~ign] > 0).all() and (lp[~ign] < 0).all()
    (lp.sum() + ent.sum()).backward()
    assert (hg.grad[ign] == 0).all() and (hg.grad[~ign] != 0).any()
    for x, c in zip((h, W, b, t), copies): assert torch.equal(x, c)
    hg2, Wg2 = h.clone().requires_grad_(), W.clone().requires_grad_()         # all ignored: zeros, no NaN
    lp, ent = linear_token_stats(hg2, Wg2, torch.full((6,), -100), backend=backend)
    (lp.sum() + ent.sum()).backward()
    assert (lp == 0).all() and (ent == 0).all() and (hg2.grad == 0).all() and (Wg2.grad == 0).all()

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_only_one_output_used_and_no_rows(backend):
    g = torch.Generator().manual_seed(4)
    h, W = torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(11, 6, generator=g, dtype=torch.float64)
    t = torch.tensor([1, 2, 3, 4, 10])
    for k in (0, 1):
        hg, hr = h.clone().requires_grad_(), h.clone().requires_grad_()
        linear_token_stats(hg, W, t, backend=backend)[k].sum().backward()
        linear_token_stats_reference(hr, W, t)[k].sum().backward()
        _close(hg.grad, hr.grad, 1e-12)
    lp, ent = linear_token_stats(h[:0].requires_grad_(), W, t[:0], backend=backend)
    assert lp.shape == ent.shape == (0,)

def test_low_precision_accumulates_in_float32():
    g = torch.Generator().manual_seed(5)
    h, W = torch.randn(16, 32, generator=g).bfloat16(), (torch.randn(300, 32, generator=g) / 4).bfloat16()
    t = torch.randint(0, 300, (16,), generator=g)
    y = F.linear(h, W).double()                                # the bf16 logits of the chunks' own GEMM, exactly
    ref = linear_token_stats_reference(y, torch.eye(300, dtype=torch.float64), t)
    for backend in ('cpu', 'cuda'):
        hg = h.clone().requires_grad_()
        lp, ent = linear_token_stats(hg, W, t, backend=backend)
        assert lp.dtype == ent.dtype == torch.float32
        _close(lp.double(), ref[0], 1e-5)                      # float32 sums of the bf16 logits
        _close(ent.double(), ref[1], 1e-5)
        (lp.sum() + ent.sum()).backward()
        assert hg.grad.dtype == torch.bfloat16 and torch.isfinite(hg.grad.float()).all()

def test_deterministic_and_non_contiguous():
    g = torch.Generator().manual_seed(6)
    h = torch.randn(8, 12, generator=g, dtype=torch.float64)
    W = torch.randn(12, 30, generator=g, dtype=torch.float64).T                 # a transposed (non-contiguous) head
    t = torch.randint(0, 30, (8,), generator=g)
    out = [_run(linear_token_stats, h.T.contiguous().T, W, None, t, torch.ones(8, dtype=torch.float64),
                torch.ones(8, dtype=torch.float64), chunk_size=3) for _ in range(2)]
    for a, b in zip(*out): assert torch.equal(a, b)
    ref = _run(linear_token_stats_reference, h, W.contiguous(), None, t, torch.ones(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64))
    for a, b in zip(out[0], ref): _close(a, b, 1e-12)

def test_compile_fullgraph():
    torch.manual_seed(7)
    h, W, b = torch.randn(9, 16, requires_grad=True), torch.randn(30, 16, requires_grad=True), torch.randn(30, requires_grad=True)
    t = torch.randint(0, 30, (9,)); t[2] = -100
    wa = torch.randn(9)
    def f(h, W, b):
        lp, ent = linear_token_stats(h, W, t, linear_bias=b, temperature=0.8, softcap=5.0)
        return (wa * lp).sum() - 0.01 * ent.sum()
    compiled = torch.compile(f, fullgraph=True, backend='aot_eager')
    le, lc = f(h, W, b), compiled(h, W, b)
    _close(lc.detach(), le.detach(), 1e-6)
    for a, c in zip(torch.autograd.grad(le, (h, W, b)), torch.autograd.grad(lc, (h, W, b))): _close(c, a, 1e-6)

_h, _W, _t = torch.randn(4, 3), torch.randn(5, 3), torch.tensor([0, 1, 2, 4])
BAD = [  # (kwargs changed from a good call, exception, part of the message)
    (dict(target=torch.tensor([0, 1, 5, 4])), ValueError, r'target must hold class indices in \[0, 5\)'),
    (dict(target=torch.tensor([0, 1, -1, 4])), ValueError, r'target must hold class indices'),
    (dict(target=torch.tensor([0, 1, 2])), ValueError, r'target must have shape \(4,\)'),
    (dict(target=torch.zeros(4)), TypeError, 'target must hold class indices'),
    (dict(input=torch.randn(4, 2)), ValueError, r'input must have shape \(\.\.\., 3\)'),
    (dict(linear_weight=torch.randn(5, 3, 1)), ValueError, r'linear_weight must have shape \(V, H\)'),
    (dict(linear_weight=torch.randn(0, 3)), ValueError, 'at least one row'),
    (dict(linear_weight=torch.randn(5, 3, dtype=torch.float64)), TypeError, 'same dtype'),
    (dict(input=torch.randint(0, 3, (4, 3))), TypeError, 'input must be float16'),
    (dict(linear_bias=torch.randn(4)), ValueError, r'linear_bias must have shape \(5,\)'),
    (dict(temperature=0.0), ValueError, 'temperature must be a float > 0, got 0.0'),
    (dict(temperature=-1), ValueError, 'temperature must be a float > 0'),
    (dict(temperature=float('nan')), ValueError, 'temperature must be a float > 0'),
    (dict(softcap=0.0), ValueError, 'softcap must be None or a float > 0'),
    (dict(ignore_index=1.5), TypeError, 'ignore_index must be an int'),
    (dict(chunk_size=0), ValueError, 'chunk_size must be None or a positive int'),
    (dict(backend='gpu'), ValueError, "backend must be"),
]

@pytest.mark.parametrize('kwargs, exc, msg', BAD)
def test_bad_inputs(kwargs, exc, msg):
    a = dict(input=_h, linear_weight=_W, target=_t) | kwargs
    with pytest.raises(exc, match=msg):
        linear_token_stats(a.pop('input'), a.pop('linear_weight'), a.pop('target'), **a)

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_huge_inputs_and_masked_classes_as_the_float64_reference(backend):
    """Hidden states of +-1e30 (rows whose softmax is one class) and a bias of -inf (masked classes, p = 0, p log p = 0):
    float32's log-probs, entropies and gradients as float64's reference. Before, e^w stopped at e^-87 ~ 1.6e-38 instead
    of 0, and 1.6e-38 times a logit gap of 1e30 gave the entropy a weight gradient of 1.7e23 (the reference's: 0.37);
    and 0 * -inf made a masked class's entropy NaN."""
    g = torch.Generator().manual_seed(0)
    h, W, b = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    h[1, 0], h[2, 1], b[4] = 1e30, -1e30, -float('inf')
    t, ga, gb = torch.tensor([1, 0, 5, 2]), torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    want = _run(linear_token_stats_reference, h, W, b, t, ga, gb)
    assert all(torch.isfinite(w).all() for w in want[1:2] + want[2:]), want
    for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        got = _run(linear_token_stats, *(x.to(dtype) for x in (h, W, b)), t, ga.to(dtype), gb.to(dtype), backend=backend)
        for w, x in zip(want, got): _close(x.double(), w, rtol)

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_half_precision_gemms_match_the_reference_in_that_dtype(dtype, backend, monkeypatch):
    """With every GEMM in half precision (the GPU's path, `_HALF_GEMMS`; forced here on the CPU; 'cuda' is the
    emulated kernels), dW's product a block of classes at a time into float32 (blocks of 7 that do not divide V, chunks
    of 6 rows that do not divide N): the outputs and gradients of the reference computed in float64 from the same
    half-precision inputs, within the half-precision GEMMs' rounding; the gradients in the inputs' dtype."""
    import seqdist.cross_entropy as ce
    monkeypatch.setattr(ce, '_HALF_GEMMS', {'cpu'}); monkeypatch.setattr(ce, 'LCE_DW_BLOCK', 7)
    g = torch.Generator().manual_seed(7)
    h, W, b = torch.randn(20, 32, generator=g), torch.randn(30, 32, generator=g) / 6, torch.randn(30, generator=g) / 4
    t = torch.randint(0, 30, (20,), generator=g); t[3] = -100
    ga, gb = torch.randn(20, generator=g), torch.randn(20, generator=g)
    hb, Wb, bb = (x.to(dtype) for x in (h, W, b))
    ours = _run(lambda *a, **k: linear_token_stats(*a, backend=backend, **k), hb, Wb, bb, t, ga, gb, chunk_size=6, softcap=3.0)
    ref = _run(linear_token_stats_reference, *(x.double() for x in (hb, Wb, bb)), t, ga.double(), gb.double(), softcap=3.0)
    assert all(x.dtype == dtype for x in ours[2:])
    for a, r in zip(ours, ref): torch.testing.assert_close(a.double(), r, rtol=3e-2, atol=3e-2)
