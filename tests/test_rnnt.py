"""RNN-T: the reference equals brute force and passes gradcheck; the closed-form gradient equals autograd; FastEmit
equals its formula; the delay penalty equals the loss of shifted log-probabilities; the three paths (reference, numba,
CUDA source in the emulator) agree; torchaudio agrees on 200+ randomised cases; edge cases, bad inputs, torch.compile,
low precision, 64-bit offsets."""
import math, random, pytest, torch
import seqdist.rnnt as rnnt
import seqdist.benchmarks.rnnt as rnnt_benchmarks
from seqdist.core import Log, Max
from seqdist.rnnt import (rnnt_loss, RNNTLoss, rnnt_op, rnnt_edges_op, posteriors, viterbi_alignments, best_path,
                          edge_log_probs, logz_reference, logz_brute_force, clean_targets, row_offsets, delay_offsets)
from seqdist.ops import launch_limits
from seqdist.utils import emulator_options

def edges(x, y, il, tl, blank, S, fused, backend, delay_penalty=0.0):
    "log Z (B,) and the edges (B, T, U+1, 2) in semiring S by `backend`."
    return rnnt_edges_op.compute(x, y, il, tl, blank, fused, S.name, delay_penalty, backend=backend)

def random_case(rng, dtype=torch.float64, max_B=4, max_T=8, max_U=5, max_V=7, full=False):
    "Random logits, targets with garbage padding, lengths (full: max lengths = the tensor's, as torchaudio wants)."
    B, T, U, V = rng.randint(1, max_B), rng.randint(1, max_T), rng.randint(0, max_U), rng.randint(2, max_V)
    blank = rng.choice([0, V - 1, -1, rng.randrange(V)])
    b = blank % V
    labels = [c for c in range(V) if c != b]
    y = torch.tensor([[rng.choice(labels) for _ in range(U)] for _ in range(B)], dtype=torch.int32).view(B, U)
    tl = torch.tensor([rng.randint(0, U) for _ in range(B)], dtype=torch.int32)
    il = torch.tensor([rng.randint(1, T) for _ in range(B)], dtype=torch.int32)
    if full: il[rng.randrange(B)], tl[rng.randrange(B)] = T, U
    scale = rng.choice([1.0, 3.0, 10.0])
    x = (torch.randn(B, T, U + 1, V, dtype=torch.float64) * scale).to(dtype)
    pad = torch.arange(U)[None] >= tl[:, None]
    y = torch.where(pad, torch.randint(-5, V + 5, y.shape, dtype=torch.int32) if not full else torch.zeros_like(y), y)
    return x, y, il, tl, blank

def loss_and_grad(x, y, il, tl, blank, **kw):
    x = x.detach().requires_grad_()
    loss = rnnt_loss(x, y, il, tl, blank, **kw)
    w = torch.arange(1, loss.numel() + 1, dtype=loss.dtype).view(loss.shape)   # a weight per sequence for 'none'
    return loss.detach(), torch.autograd.grad((loss * w).sum(), x)[0]

def paths_of(T, U):
    import itertools
    return list(itertools.combinations_with_replacement(range(T), U))

@pytest.mark.parametrize('S', [Log, Max])
def test_reference_equals_brute_force(S):
    rng = random.Random(0)
    for _ in range(30):
        x, y, il, tl, blank = random_case(rng, max_T=5, max_U=3, max_V=5)
        V = x.shape[-1]
        # brute force takes blank V-1: permute the vocabulary so that our blank sits last
        perm = [c for c in range(V) if c != blank % V] + [blank % V]
        yc, il, tl = clean_targets(x, y, il, tl, blank % V)
        bl, em = edge_log_probs(x, yc, blank % V)
        ref = logz_reference(bl, em, il, tl, S)
        for b in range(x.shape[0]):
            lp = x[b, :il[b], :tl[b] + 1].log_softmax(-1)[..., perm]
            labels = [perm.index(int(c)) for c in yc[b, :tl[b]]]
            torch.testing.assert_close(ref[b], logz_brute_force(lp, labels, S), rtol=1e-12, atol=1e-12)

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
@pytest.mark.parametrize('fused', [True, False])
def test_gradcheck(backend, fused):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    if not fused: x = x.log_softmax(-1)
    y, il, tl = torch.tensor([[1, 2], [3, 0]]), torch.tensor([4, 3]), torch.tensor([2, 1])
    f = lambda x: rnnt_loss(x, y, il, tl, blank=0, reduction='none', fused_log_softmax=fused, backend=backend)
    assert torch.autograd.gradcheck(f, (x.requires_grad_(),))

def test_closed_form_gradient_equals_autograd_through_the_reference():
    rng = random.Random(1)
    for _ in range(20):
        x, y, il, tl, blank = random_case(rng)
        for fused in (True, False):
            xx = x if fused else x.log_softmax(-1)
            ours = loss_and_grad(xx, y, il, tl, blank, reduction='none', fused_log_softmax=fused, backend='reference')
            xg = xx.detach().requires_grad_()
            yc, ilc, tlc = clean_targets(xg, y, il, tl, blank % x.shape[-1])
            cost = -logz_reference(*edge_log_probs(xg, yc, blank % x.shape[-1], fused), ilc, tlc)
            w = torch.arange(1, cost.numel() + 1, dtype=cost.dtype)
            torch.testing.assert_close(ours[0], cost.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ours[1], torch.autograd.grad((cost * w).sum(), xg)[0], rtol=1e-10, atol=1e-12)

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
def test_fastemit_equals_its_formula(backend):
    """FastEmit: the loss is unchanged, and the gradient is that of -log Z - lam * sum_{t,u} p_y(t,u) e(t,u) with the
    label edges' posteriors p_y held fixed: the label edges' gradient scaled by 1 + lam."""
    rng = random.Random(2)
    for _ in range(6 if backend == 'cuda' else 15):
        x, y, il, tl, blank = random_case(rng)
        lam = rng.choice([0.001, 0.01, 0.5])
        for fused in (True, False):
            xx = x if fused else x.log_softmax(-1)
            l0, g0 = loss_and_grad(xx, y, il, tl, blank, reduction='sum', fused_log_softmax=fused, backend=backend)
            l1, g1 = loss_and_grad(xx, y, il, tl, blank, reduction='sum', fused_log_softmax=fused, fastemit_lambda=lam, backend=backend)
            assert torch.equal(l0, l1)
            V = x.shape[-1]
            xg = xx.detach().requires_grad_()
            yc, ilc, tlc = clean_targets(xg, y, il, tl, blank % V)
            bl, em = edge_log_probs(xg, yc, blank % V, fused)
            pe = edges(xx, y, il, tl, blank % V, Log, fused, 'reference')[1][..., 1]
            surrogate = -logz_reference(bl, em, ilc, tlc).sum() - lam * (pe * em).sum()
            torch.testing.assert_close(g1, torch.autograd.grad(surrogate, xg)[0], rtol=1e-9, atol=1e-11)

def assert_same(a, b, rtol, atol):
    torch.testing.assert_close(a, b.to(a.dtype), rtol=rtol, atol=atol)

# float32: cpu and cuda run the lattice in float64 and agree with the float64 truth to float32 rounding (1e-5); the
# float32 reference runs it in float32, whose log-space forward variables (|alpha| up to a few hundred here) carry an
# absolute error of ~|alpha| 2^-24 = 1e-5, i.e. a relative 1e-5 to 1e-4 on every posterior: hence its looser bound.
TOL64, TOL32, TOL32_REF = dict(rtol=1e-9, atol=1e-12), dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-4, atol=1e-4)

def three_paths(x, y, il, tl, blank, emulated=True, **kw):
    truth = loss_and_grad(x.double(), y, il, tl, blank, backend='reference', **kw)
    backends = ['reference', 'cpu'] + (['cuda'] if emulated else [])
    for backend in backends:
        tol = TOL64 if x.dtype == torch.float64 else TOL32_REF if backend == 'reference' else TOL32
        out = loss_and_grad(x, y, il, tl, blank, backend=backend, **kw)
        assert out[0].dtype == out[1].dtype == x.dtype
        assert_same(out[0], truth[0], **tol); assert_same(out[1], truth[1], **tol)

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_three_paths_agree_on_random_cases(dtype):
    "Variable lengths, garbage padding, any blank, clamp, FastEmit, fused or not, every reduction; U = 0 and T = 1 occur."
    rng = random.Random(3 if dtype == torch.float64 else 4)
    for case in range(25):
        x, y, il, tl, blank = random_case(rng, dtype)
        kw = dict(reduction=rng.choice(['none', 'sum', 'mean']), clamp=rng.choice([-1, -1, 0.05]),
                  fastemit_lambda=rng.choice([0.0, 0.01]), fused_log_softmax=rng.random() < 0.8)
        if not kw['fused_log_softmax']: x = x.double().log_softmax(-1).to(dtype)
        with emulator_options(seed=case):
            three_paths(x, y, il, tl, blank, emulated=case % 2 == 0, **kw)

@pytest.mark.parametrize('dtype,max_threads', [(torch.float64, 1024), (torch.float32, 1024), (torch.float64, 32)])
@pytest.mark.parametrize('S', [Log, Max])                # 32 threads for U+1 = 37 nodes and V = 40: the looping paths
def test_posteriors_agree_on_every_path(dtype, S, max_threads):
    torch.manual_seed(5)
    B, T, U, V = 3, 4, 36, 40
    x = torch.randn(B, T, U + 1, V, dtype=dtype) * 2
    y = torch.randint(1, V, (B, U))
    il, tl = torch.tensor([4, 2, 1]), torch.tensor([36, 20, 0])
    ref = edges(x.double(), y, il, tl, 0, S, True, 'reference')
    for seed in (0, 1):
        with emulator_options(seed=seed), launch_limits(max_threads=max_threads):
            for backend in ('reference', 'cpu', 'cuda'):
                tol = TOL64 if dtype == torch.float64 else TOL32_REF if backend == 'reference' else TOL32
                out = edges(x, y, il, tl, 0, S, True, backend)
                assert out[1].dtype == dtype
                assert_same(out[0], ref[0], **tol); assert_same(out[1], ref[1], **tol)
    if S is Log:      # each frame's occupancy is 1 + the labels it emits; every label is emitted once
        post = ref[1]
        assert_same(post[..., 1].sum((1, 2)), tl.to(dtype), rtol=1e-5, atol=1e-5)
        assert_same(post[..., 0].sum((1, 2)), il.to(dtype), rtol=1e-5, atol=1e-5)
    if max_threads == 32:      # the loss and gradient through the looping kernels too
        with emulator_options(seed=2), launch_limits(max_threads=max_threads):
            three_paths(x[:2], y[:2], il[:2], tl[:2], 0, reduction='none')

def test_best_path_is_the_best_of_brute_force():
    rng = random.Random(6)
    for _ in range(15):
        x, y, il, tl, blank = random_case(rng, max_T=5, max_U=3, max_V=5)
        V = x.shape[-1]
        frames, score = best_path(x, y, il, tl, blank)
        yc, ilc, tlc = clean_targets(x, y, il, tl, blank % V)
        lp = x.log_softmax(-1)
        for b in range(x.shape[0]):
            Tb, Ub = int(il[b]), int(tl[b])
            best = max(paths_of(Tb, Ub), key=lambda p: path_score(lp[b], yc[b], blank % V, p, Tb))
            torch.testing.assert_close(score[b], path_score(lp[b], yc[b], blank % V, best, Tb), rtol=1e-12, atol=1e-12)
            assert frames[b, :Ub].tolist() == list(best) and (frames[b, Ub:] == -1).all()
        for backend in ('cpu', 'cuda'):
            f2, s2 = best_path(x, y, il, tl, blank, backend=backend)
            assert torch.equal(f2, frames); torch.testing.assert_close(s2, score, rtol=1e-12, atol=1e-12)

def path_score(lp, y, blank, emit_frames, T):
    s, u = 0.0, 0
    for t in range(T):
        while u < len(emit_frames) and emit_frames[u] == t: s = s + lp[t, u, y[u]]; u += 1
        s = s + lp[t, u, blank]
    return s

@pytest.mark.torchaudio
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_agrees_with_torchaudio_on_randomised_cases(dtype):
    """210 cases (float32; 60 in float16): variable lengths, clamp, every reduction, blank first or last, fused or not.
    float32: ours is within float32 rounding (1e-6) of the float64 truth, and differs from torchaudio by no more than
    torchaudio's own error against that truth plus 1e-6."""
    from seqdist.timing import load_torchaudio
    torchaudio = load_torchaudio()
    assert torchaudio is not None, "torchaudio does not import (put ../shared/anchors on sys.path for its CPU stubs)"
    ta = torchaudio.functional.rnnt_loss
    rng = random.Random(7 if dtype == torch.float32 else 8)
    for case in range(210 if dtype == torch.float32 else 60):
        x, y, il, tl, _ = random_case(rng, torch.float32, max_T=12, max_U=6, max_V=9, full=True)
        V = x.shape[-1]
        blank = rng.choice([0, V - 1, -1])
        b = blank % V
        y = torch.where(y == b, (b + 1) % V, y)       # (full=True pads with 0: keep the padding a non-blank label)
        kw = dict(blank=blank, reduction=rng.choice(['none', 'sum', 'mean']), clamp=rng.choice([-1, -1, 0.1]),
                  fused_log_softmax=rng.random() < 0.8)
        if not kw['fused_log_softmax']: x = x.log_softmax(-1)
        x = x.to(dtype)
        theirs = loss_and_grad_with(ta, x, y, il, tl, **kw)
        ours = loss_and_grad(x, y, il, tl, **kw)
        assert ours[0].dtype == theirs[0].dtype == dtype and ours[1].dtype == dtype
        if dtype == torch.float16:
            assert_same(ours[0].float(), theirs[0].float(), rtol=2e-3, atol=1e-2)
            assert_same(ours[1].float(), theirs[1].float(), rtol=0, atol=2e-3)
            continue
        truth = loss_and_grad(x.double(), y, il, tl, **kw)
        for o, t, tr in zip(ours, theirs, truth):    # (absolute: the float32 rounding of the largest terms)
            assert_same(o.double(), tr, rtol=1e-6, atol=1e-6 * max(1.0, tr.abs().max().item()))
            err = (t.double() - tr).abs().max().item()
            assert (o - t).abs().max().item() <= err + 1e-6 + 1e-6 * tr.abs().max().item()

def loss_and_grad_with(f, x, y, il, tl, blank, **kw):
    x = x.detach().requires_grad_()
    loss = f(x, y, il, tl, blank, **kw)
    w = torch.arange(1, loss.numel() + 1, dtype=loss.dtype).view(loss.shape)
    return loss.detach(), torch.autograd.grad((loss * w).sum(), x)[0]

def test_clamp_clamps_each_element_before_the_incoming_gradient():
    torch.manual_seed(9)
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64) * 3
    y, il, tl = torch.tensor([[1, 2], [2, 1]]), torch.tensor([5, 4]), torch.tensor([2, 2])
    for backend in ('reference', 'cpu', 'cuda'):
        _, g = loss_and_grad(x, y, il, tl, 0, reduction='none', backend=backend)
        _, gc = loss_and_grad(x, y, il, tl, 0, reduction='none', clamp=0.05, backend=backend)
        w = torch.tensor([1.0, 2.0], dtype=torch.float64)[:, None, None, None]
        assert (g.abs() > 0.05).any()
        torch.testing.assert_close(gc, (g / w).clamp(-0.05, 0.05) * w, rtol=1e-12, atol=1e-12)

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
def test_edge_cases(backend):
    torch.manual_seed(10)
    x = torch.randn(3, 4, 3, 5, dtype=torch.float64)
    lp = x.log_softmax(-1)
    f = lambda x, y, il, tl: rnnt_loss(x, y, il, tl, 4, reduction='none', backend=backend)
    # U = 0: blanks only; T = 1 emits every label in frame 0; a one-sequence batch
    torch.testing.assert_close(f(x[:, :, :1], torch.zeros(3, 0, dtype=torch.int32), torch.tensor([4, 2, 1]), torch.zeros(3, dtype=torch.int32)),
                               -torch.stack([lp[0, :4, 0, 4].sum(), lp[1, :2, 0, 4].sum(), lp[2, :1, 0, 4].sum()]))
    torch.testing.assert_close(f(x[:1, :1], torch.tensor([[1, 2]]), torch.tensor([1]), torch.tensor([2])),
                               -(lp[0, 0, 0, 1] + lp[0, 0, 1, 2] + lp[0, 0, 2, 4])[None])
    # repeated labels are fine in RNN-T (no blank needed between them); lengths may be shorter than the tensors
    out = f(x, torch.tensor([[1, 1], [2, 2], [3, 3]]), torch.tensor([4, 3, 1]), torch.tensor([2, 1, 0]))
    assert torch.isfinite(out).all()
    # a -inf logit for a target label that must be emitted: infinite cost, zero gradient, no NaN
    xi = x.clone(); xi[0, :, 0, 1] = -math.inf
    xi.requires_grad_()
    loss = rnnt_loss(xi, torch.tensor([[1, 2], [1, 2], [1, 2]]), torch.tensor([4, 4, 4]), torch.tensor([2, 0, 0]), 4,
                     reduction='none', backend=backend)
    assert loss[0].item() == math.inf and torch.isfinite(loss[1:]).all()
    g, = torch.autograd.grad(loss[1:].sum() + 0 * loss[0], xi)
    assert not torch.isnan(g).any() and (g[0] == 0).all()
    # a NaN logit inside the lattice: a NaN cost and NaN gradients for that sequence only, never a silent number
    xn = x.clone(); xn[1, 0, 0, 3] = math.nan
    xn.requires_grad_()
    loss = rnnt_loss(xn, torch.tensor([[1, 2], [1, 2], [1, 2]]), torch.tensor([4, 4, 4]), torch.tensor([2, 2, 2]), 4,
                     reduction='none', backend=backend)
    g, = torch.autograd.grad(loss.sum(), xn)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()
    assert torch.isnan(g[1]).any() and torch.isfinite(g[[0, 2]]).all()

def test_non_contiguous_inputs_left_unmodified():
    torch.manual_seed(11)
    base = torch.randn(5, 2, 4, 6, dtype=torch.float64)           # (T, B, U+1, V): a batch-second layout
    x = base.transpose(0, 1)                                       # (B, T, U+1, V) view, not contiguous
    y = torch.tensor([[1, 2, 3, 9], [3, 3, 1, 9]])[:, ::1][:, :3]
    il, tl = torch.tensor([5, 3]), torch.tensor([3, 2])
    saved = [t.clone() for t in (base, y, il, tl)]
    results = [loss_and_grad(x, y, il, tl, 0, reduction='none', backend=b) for b in ('reference', 'cpu', 'cuda')]
    for r in results[1:]:
        torch.testing.assert_close(r[0], results[0][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r[1], results[0][1], rtol=1e-10, atol=1e-12)
    for a, b in zip((base, y, il, tl), saved): assert torch.equal(a, b)
    torch.testing.assert_close(results[1][0], loss_and_grad(x.contiguous(), y, il, tl, 0, reduction='none')[0])

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_low_precision_inputs_are_computed_in_float32(dtype):
    torch.manual_seed(12)
    x = torch.randn(2, 6, 4, 8).to(dtype)
    y, il, tl = torch.randint(1, 8, (2, 3)), torch.tensor([6, 5]), torch.tensor([3, 2])
    l, g = loss_and_grad(x, y, il, tl, 0, reduction='none')
    l32, g32 = loss_and_grad(x.float(), y, il, tl, 0, reduction='none')
    assert l.dtype == g.dtype == dtype
    torch.testing.assert_close(l, l32.to(dtype)); torch.testing.assert_close(g, g32.to(dtype))

def test_module_equals_function():
    torch.manual_seed(13)
    x = torch.randn(2, 5, 3, 6, requires_grad=True)
    y, il, tl = torch.randint(0, 5, (2, 2), dtype=torch.int32), torch.tensor([5, 4], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    m = RNNTLoss(clamp=0.1, reduction='sum', fastemit_lambda=0.01)
    assert torch.equal(m(x, y, il, tl), rnnt_loss(x, y, il, tl, -1, 0.1, 'sum', True, 0.01))

def test_torch_compile_fullgraph():
    torch.manual_seed(14)
    x = torch.randn(3, 6, 4, 7).requires_grad_()
    y, il, tl = torch.randint(1, 7, (3, 3), dtype=torch.int32), torch.tensor([6, 4, 1], dtype=torch.int32), torch.tensor([3, 1, 0], dtype=torch.int32)
    def f(x): return rnnt_loss(x * 2.0, y, il, tl, blank=0, clamp=0.5, fastemit_lambda=0.01) * 3.0
    import torch._inductor.config as inductor_config     # (a graph cached on disk by an older seqdist would carry
    with inductor_config.patch(fx_graph_cache=False):   # the older op's output shapes: the cache cannot see them)
        eager, comp = f(x), torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(comp, x)[0], torch.autograd.grad(eager, x)[0], rtol=1e-5, atol=1e-7)

def test_torch_compile_of_the_reference():
    """The reference compiles with graph breaks around it (it checks values on the host, so not fullgraph), and its
    gradient (closed form from edge posteriors found by autograd) is the eager one: it runs eagerly, around the op."""
    torch.manual_seed(15)
    x = torch.randn(2, 4, 3, 5, dtype=torch.float64, requires_grad=True)
    y, il, tl = torch.tensor([[1, 2], [3, 1]]), torch.tensor([4, 3]), torch.tensor([2, 1])
    f = lambda x: rnnt_loss(x, y, il, tl, 0, clamp=0.1, backend='reference')
    grad = torch.autograd.grad(torch.compile(f, backend='aot_eager')(x), x)[0]   # (dynamo and AOT autograd, what the
    # graph breaks concern; inductor's code generation took a minute here and is tested by the kernels' fullgraph test)
    torch.testing.assert_close(grad, torch.autograd.grad(f(x), x)[0])

def test_row_offsets_are_64_bit():
    "The kernels' row offset at (B, T, U+1, V) = (16, 1000, 151, 4096): 9.9e9 logits, past 2^31 and 2^32."
    B, T, U1, V = 16, 1000, 151, 4096
    b, t, u = [15, 8, 0, 3], [999, 500, 0, 1], [150, 7, 0, 149]
    got = row_offsets(torch.tensor(b), torch.tensor(t), torch.tensor(u), T, U1, V).tolist()
    assert got == [((bb * T + tt) * U1 + uu) * V for bb, tt, uu in zip(b, t, u)]
    assert got[0] > 2 ** 33 and got[1] > 2 ** 32

@pytest.mark.torchaudio
def test_bench_quick_rows_have_the_shared_format():
    rows = rnnt_benchmarks.bench_rnnt(quick=True)
    assert len(rows) == 1 and set(rows[0]) == {'op', 'shape', 'anchor', 'anchor_ms', 'ours_ms', 'ratio', 'check'}
    assert rows[0]['ours_ms'] > 0 and rows[0]['ratio'] == rows[0]['anchor_ms'] / rows[0]['ours_ms']

x0 = torch.randn(2, 4, 3, 5)
y0, il0, tl0 = torch.tensor([[1, 2], [3, 1]], dtype=torch.int32), torch.tensor([4, 3], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
BAD = [
    (dict(logits=x0[0]), ValueError, r"logits must have shape \(B, T, U\+1, V\), got \(4, 3, 5\)"),
    (dict(logits=x0.long()), TypeError, r"logits must be float16, bfloat16, float32 or float64, got torch.int64"),
    (dict(logits=[1.0]), TypeError, r"logits must be a tensor, got list"),
    (dict(logits=x0[:, :0]), ValueError, r"logits must have B, T, U\+1 and V all >= 1, got shape \(2, 0, 3, 5\)"),
    (dict(targets=y0.float()), TypeError, r"targets must hold integers \(torchaudio: int32\), got dtype torch.float32"),
    (dict(targets=y0[:1]), ValueError, r"targets must have shape \(2, U\), got \(1, 2\)"),
    (dict(targets=y0[:, 0]), ValueError, r"targets must have shape \(2, U\), got \(2,\)"),
    (dict(targets=torch.tensor([[1, 7], [3, 4]])), ValueError, r"targets must hold labels in \[0, V\) = \[0, 5\), got \[7\]"),
    (dict(targets=torch.tensor([[1, 4], [3, 4]])), ValueError, r"targets contain the blank label 4 within their target_lengths"),
    (dict(targets=torch.tensor([[1, 0], [3, 4]]), blank=0), ValueError, r"targets contain the blank label 0 within"),
    (dict(logit_lengths=torch.tensor([4, 5])), ValueError, r"logit_lengths must be in \[1, T\] = \[1, 4\], got \[5\]"),
    (dict(logit_lengths=torch.tensor([0, 4])), ValueError, r"logit_lengths must be in \[1, T\] = \[1, 4\], got \[0\]"),
    (dict(target_lengths=torch.tensor([3, 1])), ValueError, r"target_lengths must be in \[0, min\(U, targets.shape\[1\]\)\] = \[0, 2\] \(logits have U\+1 = 3\), got \[3\]"),
    (dict(target_lengths=torch.tensor([-1, 1])), ValueError, r"target_lengths must be in \[0, min.*got \[-1\]"),
    (dict(targets=y0[:, :1]), ValueError, r"target_lengths must be in \[0, min\(U, targets.shape\[1\]\)\] = \[0, 1\]"),
    (dict(logit_lengths=torch.tensor([4.0, 3.0])), TypeError, r"logit_lengths must hold integers \(torchaudio: int32\), got dtype torch.float32"),
    (dict(logit_lengths=torch.tensor([4, 3, 3])), ValueError, r"logit_lengths must have shape \(2\), got \(3,\)"),
    (dict(target_lengths=[2, 1]), TypeError, r"target_lengths must be a tensor, got list"),
    (dict(target_lengths=torch.tensor([2, 1], device='meta')), ValueError, r"target_lengths is on meta: it must be on the CPU or on cpu"),
    (dict(blank=5), ValueError, r"blank must be an int in \[-V, V\) = \[-5, 5\) \(negative counts from the end\), got 5"),
    (dict(blank=1.0), ValueError, r"blank must be an int in \[-V, V\)"),
    (dict(reduction='avg'), ValueError, r"reduction must be 'none', 'sum' or 'mean', got 'avg'"),
    (dict(clamp='1'), TypeError, r"clamp must be a real number, got '1'"),
    (dict(fastemit_lambda=-0.1), ValueError, r"fastemit_lambda must be >= 0, got -0.1"),
    (dict(fastemit_lambda=math.nan), ValueError, r"fastemit_lambda must be finite, got nan"),
    (dict(delay_penalty=math.inf), ValueError, r"delay_penalty must be finite, got inf"),
    (dict(delay_penalty=math.nan), ValueError, r"delay_penalty must be finite, got nan"),
    (dict(delay_penalty='0.1'), TypeError, r"delay_penalty must be a real number, got '0.1'"),
    (dict(delay_penalty=None), TypeError, r"delay_penalty must be a real number, got None"),
    (dict(delay_penalty=torch.tensor(0.1)), TypeError, r"delay_penalty must be a real number, got tensor\(0.1000\)"),
    (dict(backend='gpu'), ValueError, r"backend must be 'auto', 'cpu', 'cuda' or 'reference', got 'gpu'"),
]

@pytest.mark.parametrize('bad,error,message', BAD)
def test_bad_input_is_a_clear_error(bad, error, message):
    args = dict(logits=x0, targets=y0, logit_lengths=il0, target_lengths=tl0)
    args.update(bad)
    with pytest.raises(error, match=message): rnnt_loss(**args)

def test_peak_extra_memory_is_about_one_gradient():
    "fwd+bwd in a fresh process (the anchors' method): the gradient is the only logits-sized allocation."
    B, T, U, V = 8, 100, 30, 64
    extra, logits_mb = rnnt_benchmarks.rnnt_peak_mb(B, T, U, V), B * T * (U + 1) * V * 4 / 2**20
    assert extra <= 1.05 * logits_mb, f"peak extra {extra:.2f} MB for {logits_mb:.2f} MB of logits"

def test_cuda_path_launches_three_kernels_per_fwd_bwd(monkeypatch):
    "The launch count stays seen: lse, alpha and beta (one launch), gradient; nothing else on the hot path."
    from seqdist import utils
    names, launch = [], utils.Kernel.__call__
    def counted(self, *args, **kw):
        names.append(self.name)
        return launch(self, *args, **kw)
    monkeypatch.setattr(utils.Kernel, '__call__', counted)
    x = torch.randn(2, 3, 3, 4, requires_grad=True)
    y, il, tl = torch.tensor([[1, 2], [2, 1]]), torch.tensor([3, 2]), torch.tensor([2, 1])
    torch.autograd.grad(rnnt_loss(x, y, il, tl, 0, backend='cuda'), x)
    assert names == ['rnnt_lse', 'rnnt_alpha_beta', 'rnnt_grad']

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_the_ops_pass_opcheck(backend):
    "Eager calls go through an autograd.Function (less host time); torch.compile traces the op: check it as an op."
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 4, 6, dtype=torch.float64, requires_grad=True)
    # full lengths: the CUDA path's saved lattice is left unwritten past a sequence's lengths (never read), and
    # opcheck compares every output element between eager and traced calls
    targets, ll, tl = torch.tensor([[1, 2, 3], [4, 5, 1]]), torch.tensor([5, 5]), torch.tensor([3, 3])
    for delay in (0.0, 0.1):
        torch.library.opcheck(rnnt_op.custom_op, (logits, targets, ll, tl, 0, True, -1.0, 0.0, delay, backend))
        for S in (Log, Max):
            torch.library.opcheck(rnnt_edges_op.custom_op, (logits.detach(), targets, ll, tl, 0, True, S.name, delay, backend))

def test_inputs_are_checked_and_cleaned_once_per_forward_and_backward(monkeypatch):
    "The backward takes the forward's state: the targets are cleaned (and their values checked) once per fwd+bwd."
    calls, clean = [], rnnt.clean_targets
    monkeypatch.setattr(rnnt, 'clean_targets', lambda *args: calls.append(args[-1]) or clean(*args))
    x = torch.randn(2, 4, 3, 5, requires_grad=True)
    y, il, tl = torch.tensor([[1, 2], [3, 1]]), torch.tensor([4, 3]), torch.tensor([2, 1])
    for backend in ('cpu', 'cuda', 'reference'):
        calls.clear()
        torch.autograd.grad(rnnt_loss(x, y, il, tl, 0, backend=backend), x)
        assert calls == [True], (backend, calls)

def test_check_targets_checks_and_clean_targets_cleans():
    """`check_targets` makes every check of the lengths and labels (3 requires); `clean_targets(check=False)` only pads
    and casts (what an op prepares without checks: a compiled backward, or an op run inside another, like the joint's)."""
    from seqdist.checks import count_checks
    x = torch.randn(2, 4, 3, 5)
    y, il, tl = torch.tensor([[1, 2], [3, 9]], dtype=torch.int32), torch.tensor([4, 3]), torch.tensor([2, 1])  # 9: padding
    with count_checks() as n: assert rnnt.check_targets(x, y, il, tl, 0) is None
    assert sum(n.values()) == 3, n
    with count_checks() as n: yc, ilc, tlc = clean_targets(x, y, il, tl, 0, check=False)
    assert not n and yc.tolist() == [[1, 2, 0], [3, 0, 0]] and ilc.dtype == tlc.dtype == yc.dtype == torch.int64
    for bad, message in ((dict(il=il + 1), r"logit_lengths must be in \[1, T\] = \[1, 4\], got \[5\]"),
                         (dict(tl=tl + 1), r"target_lengths must be in \[0, min"), (dict(y=y * 0), "the blank label 0")):
        a = dict(y=y, il=il, tl=tl) | bad
        with pytest.raises(ValueError, match=message): rnnt.check_targets(x, a['y'], a['il'], a['tl'], 0)
        with pytest.raises(ValueError, match=message): clean_targets(x, a['y'], a['il'], a['tl'], 0)
        clean_targets(x, a['y'], a['il'], a['tl'], 0, check=False)           # unchecked: no error

# The delay penalty (k2's): delay_penalty * ((T_b - 1)/2 - t) added to every label edge's log-probability in frame t

def shifted(x, il, blank, dp, fused):
    "The log-probabilities with the delay offsets added to every non-blank column: what the penalised loss reads."
    lp = x.log_softmax(-1) if fused else x
    V = x.shape[-1]
    return lp + (delay_offsets(il, x.shape[1], dp)[:, :, None, None] * (torch.arange(V) != blank % V)).to(x.dtype)

def test_delay_offsets_are_k2s():
    il = torch.tensor([5, 2], dtype=torch.int32)
    got = delay_offsets(il, 5, 0.1)
    assert got.dtype == torch.float64 and got.shape == (2, 5)
    want = [[0.1 * ((5 - 1) / 2 - t) for t in range(5)], [0.1 * ((2 - 1) / 2 - t) for t in range(5)]]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)
    import seqdist.tdt as tdt, seqdist.joint as joint           # one definition, re-exported where it was
    assert tdt.delay_offsets is joint.delay_offsets is delay_offsets
    assert 'delay_offsets' in tdt.__all__ and 'delay_offsets' in joint.__all__

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
def test_delay_penalty_equals_the_loss_of_shifted_log_probs(backend):
    """Value and gradient equal `rnnt_loss(fused_log_softmax=False)` of the shifted log-probabilities: with fused
    logits, both differentiated through autograd to the raw logits (the log_softmax inside `shifted`); with
    log-probabilities, w.r.t. them directly (both sides take them as they are). FastEmit composes the same way."""
    rng = random.Random(20)
    for case in range(8 if backend == 'cuda' else 20):
        x, y, il, tl, blank = random_case(rng)
        dp, lam = rng.choice([0.01, 0.3, -0.2, 1.5]), rng.choice([0.0, 0.0, 0.02])
        for fused in (True, False):
            xx = x if fused else x.log_softmax(-1)
            kw = dict(reduction='none', fastemit_lambda=lam)
            ours = loss_and_grad(xx, y, il, tl, blank, fused_log_softmax=fused, delay_penalty=dp, backend=backend, **kw)
            f = lambda z: rnnt_loss(shifted(z, il, blank, dp, fused), y, il, tl, blank, fused_log_softmax=False,
                                    backend='cpu', **kw)
            want = loss_and_grad_with(lambda z, *a, **k: f(z), xx, y, il, tl, blank)
            assert_same(ours[0], want[0], **TOL64); assert_same(ours[1], want[1], **TOL64)
            plain = loss_and_grad(xx, y, il, tl, blank, fused_log_softmax=fused, backend=backend, **kw)
            if ((tl > 0) & (il > 1)).any(): assert not torch.equal(ours[0], plain[0])   # (one frame: all offsets 0)

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_delay_three_paths_agree_on_random_cases(dtype):
    "Variable lengths, garbage padding, any blank, clamp, FastEmit, fused or not, every reduction, with a delay penalty."
    rng = random.Random(21 if dtype == torch.float64 else 22)
    for case in range(16):
        x, y, il, tl, blank = random_case(rng, dtype)
        kw = dict(reduction=rng.choice(['none', 'sum', 'mean']), clamp=rng.choice([-1, -1, 0.05]),
                  fastemit_lambda=rng.choice([0.0, 0.01]), fused_log_softmax=rng.random() < 0.8,
                  delay_penalty=rng.choice([0.01, 0.2, -0.1, 2.0]))
        if not kw['fused_log_softmax']: x = x.double().log_softmax(-1).to(dtype)
        with emulator_options(seed=case):
            three_paths(x, y, il, tl, blank, emulated=case % 2 == 0, **kw)

def test_delay_with_clamp_clamps_the_penalised_gradient():
    torch.manual_seed(23)
    x = torch.randn(2, 6, 3, 4, dtype=torch.float64) * 3
    y, il, tl = torch.tensor([[1, 2], [2, 1]]), torch.tensor([6, 4]), torch.tensor([2, 2])
    for backend in ('reference', 'cpu', 'cuda'):
        _, g = loss_and_grad(x, y, il, tl, 0, reduction='sum', delay_penalty=0.4, backend=backend)
        l, gc = loss_and_grad(x, y, il, tl, 0, reduction='sum', clamp=0.05, delay_penalty=0.4, backend=backend)
        assert (g.abs() > 0.05).any() and not torch.equal(g, loss_and_grad(x, y, il, tl, 0, reduction='sum', backend=backend)[1])
        torch.testing.assert_close(gc, g.clamp(-0.05, 0.05), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(l, loss_and_grad(x, y, il, tl, 0, reduction='sum', delay_penalty=0.4, backend=backend)[0])

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
@pytest.mark.parametrize('fused', [True, False])
def test_delay_gradcheck(backend, fused):
    torch.manual_seed(24)
    x = torch.randn(2, 5, 3, 5, dtype=torch.float64)
    if not fused: x = x.log_softmax(-1)
    y, il, tl = torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 3]), torch.tensor([2, 1])
    f = lambda x: rnnt_loss(x, y, il, tl, blank=0, reduction='none', fused_log_softmax=fused, delay_penalty=0.3,
                            fastemit_lambda=0.0, backend=backend)
    assert torch.autograd.gradcheck(f, (x.requires_grad_(),))

@pytest.mark.parametrize('S', [Log, Max])
def test_delay_posteriors_and_best_path_are_those_of_the_shifted_lattice(S):
    "posteriors, viterbi_alignments and best_path take the penalty: those of the shifted log-probabilities, on every path."
    rng = random.Random(25)
    for case in range(10):
        x, y, il, tl, blank = random_case(rng, max_T=7, max_U=4)
        dp = rng.choice([0.2, -0.3, 1.0])
        want = posteriors(shifted(x, il, blank, dp, True), y, il, tl, blank, S, fused_log_softmax=False)
        for backend in ('reference', 'cpu', 'cuda'):
            got = posteriors(x, y, il, tl, blank, S, delay_penalty=dp, backend=backend)
            assert_same(got, want, **TOL64)
        if S is Max:
            assert torch.equal(viterbi_alignments(x, y, il, tl, blank, delay_penalty=dp), want)
            frames, score = best_path(shifted(x, il, blank, dp, True), y, il, tl, blank, fused_log_softmax=False)
            for backend in ('cpu', 'cuda'):
                f2, s2 = best_path(x, y, il, tl, blank, delay_penalty=dp, backend=backend)
                assert torch.equal(f2, frames); assert_same(s2, score, **TOL64)

def test_delay_moves_the_labels_earlier():
    """A positive penalty tilts the paths by exp(-delay * sum_u t_u), so the expected sum of the labels' frames falls
    (its derivative in the penalty is minus its variance); a negative one raises it (same logits)."""
    torch.manual_seed(26)
    x = torch.randn(2, 30, 4, 6, dtype=torch.float64)
    y, il, tl = torch.tensor([[1, 2, 3], [4, 5, 1]]), torch.tensor([30, 20]), torch.tensor([3, 3])
    def mean_frame(dp):
        pe = posteriors(x, y, il, tl, 0, delay_penalty=dp)[..., :3, 1]          # (B, T, U): label u from (t, u)
        return (pe * torch.arange(30, dtype=x.dtype)[None, :, None]).sum((1, 2))   # (B,): the labels' frames, summed
    early, plain, late = mean_frame(0.5), mean_frame(0.0), mean_frame(-0.5)
    assert (early < plain).all() and (plain < late).all()

def test_delay_torch_compile_fullgraph():
    torch.manual_seed(27)
    x = torch.randn(3, 6, 4, 7).requires_grad_()
    y, il, tl = torch.randint(1, 7, (3, 3), dtype=torch.int32), torch.tensor([6, 4, 1], dtype=torch.int32), torch.tensor([3, 1, 0], dtype=torch.int32)
    def f(x): return rnnt_loss(x * 2.0, y, il, tl, blank=0, fastemit_lambda=0.01, delay_penalty=0.2) * 3.0
    import torch._inductor.config as inductor_config
    with inductor_config.patch(fx_graph_cache=False):
        eager, comp = f(x), torch.compile(f, fullgraph=True)(x)
    assert not torch.equal(eager, rnnt_loss(x * 2.0, y, il, tl, blank=0) * 3.0)
    torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(comp, x)[0], torch.autograd.grad(eager, x)[0], rtol=1e-5, atol=1e-7)

def test_delay_module_equals_function():
    torch.manual_seed(28)
    x = torch.randn(2, 5, 3, 6, requires_grad=True)
    y, il, tl = torch.randint(0, 5, (2, 2), dtype=torch.int32), torch.tensor([5, 4], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    m = RNNTLoss(reduction='sum', fastemit_lambda=0.01, delay_penalty=0.1)
    assert torch.equal(m(x, y, il, tl), rnnt_loss(x, y, il, tl, -1, -1, 'sum', True, 0.01, 0.1))

@pytest.mark.parametrize('bad,error,message', [
    (math.inf, ValueError, r"delay_penalty must be finite, got inf"),
    ('0.1', TypeError, r"delay_penalty must be a real number, got '0.1'"),
    (True, TypeError, r"delay_penalty must be a real number, got True")])
def test_delay_bad_input_in_the_alignment_functions(bad, error, message):
    for f in (posteriors, viterbi_alignments, best_path):
        with pytest.raises(error, match=message): f(x0, y0, il0, tl0, delay_penalty=bad)
