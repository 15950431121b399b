"""Every question on the CTC lattice against enumeration of all its alignments: entropy, KL and cross-entropy (values and
gradcheck), k-best alignments, exact samples (a chi-square test and per-frame occupancy), a peaky case, variable and
zero lengths, infeasible targets, bad inputs; and the laws of the semirings with components."""
import math, decimal
import pytest, torch
from seqdist.core import Log, Max, Entropy, KL, CrossEntropy, KMax, log_softmax_parts
from seqdist.ctc import (alignments_brute_force, interleave_blanks, logz_reference, posteriors, alignment_entropy,
                         alignment_kl, alignment_cross_entropy, kbest_alignments, sample_alignments, ctc_loss)
from seqdist.ops import launch_limits
from sampling_checks import chi_square, chi_square_bound, check_counts

BACKENDS = ['cpu', 'reference']     # every question runs on both, against the same enumeration

def close(a, b, rtol=1e-12): torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12)

def random_state(S, shape, g):
    "A random state of S: log-weights (normal), accumulators >= 0; KMax's k scores sorted."
    if S.components and S.name.startswith('KMax'):
        return torch.randn(S.components, *shape, generator=g, dtype=torch.float64).sort(0, descending=True).values
    w = torch.randn(S.components - 1, *shape, generator=g, dtype=torch.float64)
    return torch.cat([w, torch.rand(1, *shape, generator=g, dtype=torch.float64)])

@pytest.mark.parametrize('S', [Entropy, KL, CrossEntropy, KMax(1), KMax(3)], ids=str)
def test_semiring_laws_with_components(S):
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        a, b, c = (random_state(S, (4, 5), g) for _ in range(3))
        plus = lambda *xs: S.sum(torch.stack(xs, -1), dim=-1)
        close(plus(plus(a, b), c), plus(a, plus(b, c)))
        close(plus(a, b), plus(b, a))
        close(S.mul(S.mul(a, b), c), S.mul(a, S.mul(b, c)))
        close(plus(a, S.full(S.zero, a)), a)
        close(S.mul(a, S.full(S.one, a)), a)
        close(S.mul(a, plus(b, c)), plus(S.mul(a, b), S.mul(a, c)))

def test_log_softmax_parts_is_exact_for_the_dominant_entry():
    w = torch.tensor([0.0, -50.0, -60.0], dtype=torch.float64)
    lse, lp = log_softmax_parts(w)
    rest = math.exp(-50) + math.exp(-60)
    assert lse.item() == math.log1p(rest) and lp[0].item() == -math.log1p(rest)       # not 0: the tiny entropy lives here
    close(lp, w.log_softmax(0))

# -- tiny lattices and their enumeration ------------------------------------------------------------------------------

def batch(seed, T=6, C=3):
    "Random fp64 log_probs for a batch with repeats, an empty target, a shorter input, and (last) infeasible targets."
    g = torch.Generator().manual_seed(seed)
    targets = [[1, 2], [2, 2], [], [1, 2, 1], [2, 1], [1, 1, 1, 1]]
    il = [T, T, T - 1, T, T - 2, T]                        # the last: 4 labels + 3 repeats > 6 frames
    N = len(targets)
    lp = torch.randn(T, N, C, generator=g, dtype=torch.float64).log_softmax(-1)
    lq = torch.randn(T, N, C, generator=g, dtype=torch.float64).log_softmax(-1)
    L = max(map(len, targets))
    tg = torch.tensor([t + [0] * (L - len(t)) for t in targets])
    return lp, lq, tg, torch.tensor(il), torch.tensor([len(t) for t in targets]), targets

def enumerate_paths(lp, b, T_b, target, C):
    "The alignments of sequence b (M, T_b) and their scores (M,), by brute force."
    paths = torch.tensor(alignments_brute_force(T_b, C, target), dtype=torch.long).view(-1, T_b)
    return paths, lp[torch.arange(T_b), b][:, paths].diagonal(dim1=0, dim2=2).sum(-1) if len(paths) else lp.new_zeros(0)

def path_scores(lp, b, paths):
    T_b = paths.shape[1]
    return lp[torch.arange(T_b)[None], b, paths].sum(-1)

def exact(lp, lq, b, T_b, target):
    "Entropy, KL and cross-entropy of sequence b by enumeration (0 if it has no alignment)."
    C = lp.shape[-1]
    paths = torch.tensor(alignments_brute_force(T_b, C, target), dtype=torch.long).view(-1, T_b)
    if len(paths) == 0: return 0.0, 0.0, 0.0
    a, q = path_scores(lp, b, paths).log_softmax(0), path_scores(lq, b, paths).log_softmax(0)
    p = a.exp()
    return -(p * a).sum().item(), (p * (a - q)).sum().item(), -(p * q).sum().item()

@pytest.mark.parametrize('seed', range(4))
@pytest.mark.parametrize('backend', BACKENDS)
def test_entropy_kl_cross_entropy_equal_enumeration(seed, backend):
    lp, lq, tg, il, tl, targets = batch(seed)
    h = alignment_entropy(lp, tg, il, tl, backend=backend)
    kl = alignment_kl(lp, lq, tg, il, tl, backend=backend)
    ce = alignment_cross_entropy(lp, lq, tg, il, tl, backend=backend)
    want = torch.tensor([exact(lp, lq, b, int(il[b]), t) for b, t in enumerate(targets)], dtype=torch.float64)
    for got, col in ((h, 0), (kl, 1), (ce, 2)):
        torch.testing.assert_close(got, want[:, col], rtol=1e-10, atol=1e-14)
    assert h[2] == 0 and h[-1] == 0 and kl[-1] == 0 and ce[-1] == 0         # one alignment; none
    assert alignment_kl(lp, lp, tg, il, tl, backend=backend).eq(0).all()                    # KL(p || p) is exactly 0
    close(alignment_cross_entropy(lp, lp, tg, il, tl, backend=backend), h)
    close(alignment_entropy(lp, tg, il, tl, reduction='sum', backend=backend), h.sum())
    close(alignment_entropy(lp, tg, il, tl, reduction='mean', backend=backend), (h / tl.clamp(min=1)).mean())

def test_the_first_component_is_log_z_and_kmax_1_is_max():
    lp, lq, tg, il, tl, _ = batch(0)
    ext = interleave_blanks(tg, 0)
    x = lp.gather(2, ext[None].expand(lp.shape[0], -1, -1))
    y = lq.gather(2, ext[None].expand(lp.shape[0], -1, -1))
    logz, best = logz_reference(x, ext, il, tl, 0, Log), logz_reference(x, ext, il, tl, 0, Max)
    close(logz_reference(x, ext, il, tl, 0, Entropy)[0], logz)
    both = logz_reference(torch.stack([x, y]), ext, il, tl, 0, KL)
    close(both[0], logz); close(both[1], logz_reference(y, ext, il, tl, 0, Log))
    assert torch.equal(logz_reference(x, ext, il, tl, 0, KMax(1))[0], best)
    close(logz_reference(x, ext, il, tl, 0, KMax(4))[0], best)
    assert Log.is_zero(logz[-1]) and Log.is_zero(logz_reference(x, ext, il, tl, 0, Entropy)[0, -1])

@pytest.mark.parametrize('backend', BACKENDS)
def test_gradcheck_of_entropy_kl_and_cross_entropy(backend):
    lp, lq, tg, il, tl, _ = batch(1, T=5)
    x, y = lp[:, :4].detach().requires_grad_(), lq[:, :4].detach().requires_grad_()
    tg, il, tl = tg[:4], il[:4].clamp(max=5), tl[:4]
    assert torch.autograd.gradcheck(lambda x: alignment_entropy(x.log_softmax(-1), tg, il, tl, backend=backend), (x,))
    assert torch.autograd.gradcheck(lambda x, y: alignment_kl(x.log_softmax(-1), y.log_softmax(-1), tg, il, tl, backend=backend), (x, y))
    assert torch.autograd.gradcheck(lambda x, y: alignment_cross_entropy(x.log_softmax(-1), y.log_softmax(-1), tg, il, tl, backend=backend), (x, y))

@pytest.mark.parametrize('backend', BACKENDS)
def test_gradient_of_entropy_is_zero_where_there_is_no_alignment(backend):
    lp, _, tg, il, tl, _ = batch(2)
    x = lp.detach().requires_grad_()
    alignment_entropy(x, tg, il, tl, backend=backend).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad[:, -1].eq(0).all() and x.grad[:, 2].eq(0).all()

# -- k-best -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('k', [1, 4, 16])
@pytest.mark.parametrize('seed', range(3))
@pytest.mark.parametrize('backend', BACKENDS)
def test_kbest_equals_the_sorted_enumeration(seed, k, backend):
    lp, _, tg, il, tl, targets = batch(seed)
    T, N, C = lp.shape
    x = lp.detach().requires_grad_()
    labels, scores = kbest_alignments(x, tg, il, tl, k=k, backend=backend)
    assert labels.shape == (k, N, T) and scores.shape == (k, N) and labels.dtype == tg.dtype
    for b, target in enumerate(targets):
        T_b = int(il[b])
        paths = torch.tensor(alignments_brute_force(T_b, C, target), dtype=torch.long).view(-1, T_b)
        s = path_scores(lp, b, paths)
        order = s.argsort(descending=True)[:k]
        m = len(order)
        torch.testing.assert_close(scores[:m, b].detach(), s[order], rtol=1e-12, atol=1e-12)
        assert torch.equal(labels[:m, b, :T_b], paths[order]) and labels[:m, b, T_b:].eq(0).all()   # blank past T_b
        assert labels[m:, b].eq(-1).all() and scores[m:, b].eq(-math.inf).all()                       # padding
    # the scores are differentiable: the gradient of a path's score counts its labels at each frame
    scores[0].masked_fill(torch.isinf(scores[0]), 0).sum().backward()
    one_hot = torch.zeros_like(lp).scatter_(2, labels[0].clamp(min=0).T[..., None], 1.0)
    valid = (torch.arange(T)[:, None] < il[None]) & torch.isfinite(scores[0])[None]
    torch.testing.assert_close(x.grad, torch.where(valid[..., None], one_hot, 0.0))

@pytest.mark.parametrize('backend', BACKENDS)
def test_kbest_pads_when_there_are_fewer_alignments(backend):
    lp = torch.randn(3, 1, 3, dtype=torch.float64).log_softmax(-1)
    labels, scores = kbest_alignments(lp, torch.tensor([[1, 2]]), [3], [2], k=16, backend=backend)     # (0|1)12, 1(1|2)2, 12(2|0): 5
    assert torch.isfinite(scores[:5]).all() and scores[5:].eq(-math.inf).all() and labels[5:].eq(-1).all()
    assert not scores.requires_grad                                                   # log_probs did not require it
    assert (scores[:-1] >= scores[1:]).all()
    assert len({tuple(l) for l in labels[:5, 0].tolist()}) == 5

# -- samples ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('backend', BACKENDS)
def test_samples_match_the_exact_path_probabilities(backend):
    lp, _, tg, il, tl, targets = batch(5, T=6, C=3)
    lp = (lp * 0.7).log_softmax(-1)        # a flatter posterior: more paths with counts to test
    T, N, C = lp.shape
    n = 20000
    labels, logp = sample_alignments(lp, tg, il, tl, n=n, generator=torch.Generator().manual_seed(0), backend=backend)
    assert labels.shape == (n, N, T) and logp.shape == (n, N)
    for b, target in enumerate(targets):
        T_b = int(il[b])
        paths = torch.tensor(alignments_brute_force(T_b, C, target), dtype=torch.long).view(-1, T_b)
        if len(paths) == 0:
            assert labels[:, b].eq(-1).all() and logp[:, b].eq(-math.inf).all(); continue
        assert labels[:, b, T_b:].eq(0).all()
        logprob = path_scores(lp, b, paths).log_softmax(0)
        index = {tuple(p): i for i, p in enumerate(paths.tolist())}
        drawn = torch.tensor([index[tuple(p)] for p in labels[:, b, :T_b].tolist()])    # KeyError: not an alignment
        torch.testing.assert_close(logp[:, b], logprob[drawn], rtol=1e-10, atol=1e-12)
        if len(paths) == 1: continue
        df = check_counts(drawn, logprob, n, b)
    # per-frame occupancy within 5 sigma of the label posteriors
    post = posteriors(lp, tg, il, tl, backend='cpu')                                       # (T, N, C)
    feasible = torch.isfinite(logp[0])
    freq = torch.nn.functional.one_hot(labels.clamp(min=0), C).double().mean(0).transpose(0, 1)   # (T, N, C)
    sigma = (post * (1 - post) / n).sqrt()
    valid = (torch.arange(T)[:, None] < il[None]) & feasible[None]
    assert ((freq - post).abs() <= 5 * sigma + 1e-12)[valid].all()

@pytest.mark.parametrize('backend', BACKENDS)
def test_samples_are_reproducible_from_the_generator(backend):
    lp, _, tg, il, tl, _ = batch(3)
    a = sample_alignments(lp, tg, il, tl, n=50, generator=torch.Generator().manual_seed(7), backend=backend)
    b = sample_alignments(lp, tg, il, tl, n=50, generator=torch.Generator().manual_seed(7), backend=backend)
    c = sample_alignments(lp, tg, il, tl, n=50, generator=torch.Generator().manual_seed(8), backend=backend)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    torch.manual_seed(1); d = sample_alignments(lp, tg, il, tl, n=50, backend=backend)
    torch.manual_seed(1); e = sample_alignments(lp, tg, il, tl, n=50, backend=backend)
    assert torch.equal(d[0], e[0])

@pytest.mark.parametrize('backend', BACKENDS)
def test_sample_log_probabilities_are_differentiable(backend):
    lp, _, tg, il, tl, _ = batch(4)
    x = lp[:, :4].detach().requires_grad_()
    labels, logp = sample_alignments(x, tg[:4], il[:4], tl[:4], n=3, generator=torch.Generator().manual_seed(0), backend=backend)
    logp.sum().backward()
    # d log p(path) / d log_probs = path indicator - posteriors (per sample)
    post = posteriors(x.detach(), tg[:4], il[:4], tl[:4], backend='cpu')
    one_hot = torch.nn.functional.one_hot(labels.clamp(min=0), x.shape[-1]).double().sum(0).transpose(0, 1)
    valid = (torch.arange(x.shape[0])[:, None] < il[:4][None])[..., None]
    torch.testing.assert_close(x.grad, torch.where(valid, one_hot - 3 * post, 0.0))

# -- a peaky model: tiny entropy --------------------------------------------------------------------------------------

def entropy_high_precision(lp, b, T_b, target, digits=60):
    "The entropy of sequence b's alignments by enumeration in decimal arithmetic with `digits` digits (every operation)."
    D = decimal.Decimal
    with decimal.localcontext() as ctx:
        ctx.prec = digits
        paths = alignments_brute_force(T_b, lp.shape[-1], target)
        scores = [sum((D(lp[t, b, c].item()) for t, c in enumerate(p)), D(0)) for p in paths]   # fp64 values are exact
        m = max(scores)
        logz = m + sum(((s - m).exp() for s in scores), D(0)).ln()
        return float(-sum((s - logz).exp() * (s - logz) for s in scores))

@pytest.mark.parametrize('sharpness', [5.0, 20.0, 40.0])
@pytest.mark.parametrize('backend', BACKENDS)
def test_entropy_of_a_peaky_model_is_accurate(sharpness, backend):
    g = torch.Generator().manual_seed(0)
    T, C = 7, 3
    targets = [[1, 2], [2, 1, 2]]
    tg = torch.tensor([[1, 2, 0], [2, 1, 2]])
    logits = torch.randn(T, 2, C, generator=g, dtype=torch.float64)
    for b, t in enumerate(targets):                 # one alignment is much the likeliest
        for f, c in enumerate(([0] + [c for c in t for _ in (0, 1)] + [0] * T)[:T]): logits[f, b, c] += 3
    lp = (logits * sharpness).log_softmax(-1)
    h = alignment_entropy(lp, tg, [T, T], [2, 3], backend=backend)
    for b, t in enumerate(targets):
        want = entropy_high_precision(lp, b, T, t)
        assert abs(h[b].item() - want) <= 1e-12 * want, (sharpness, b, h[b].item(), want)
    # (what log Z - E[score] would give at sharpness 40, where the entropy is ~1e-40: zero or noise, never 1e-40)

@pytest.mark.parametrize('backend', BACKENDS)
def test_naive_entropy_would_fail_where_ours_does_not(backend):
    T, C, target = 6, 4, [1, 2]
    lp = torch.full((T, 1, C), -60.0, dtype=torch.float64)
    for f, c in enumerate([0, 1, 1, 2, 2, 0]): lp[f, 0, c] = 0.0
    lp[:, 0, 3] = 2.0                                       # a label outside the target takes most of each frame
    lp = lp.log_softmax(-1)
    want = entropy_high_precision(lp, 0, T, target)
    h = alignment_entropy(lp, torch.tensor([target]), [T], [2], backend=backend)[0].item()
    assert 0 < want < 1e-20 and abs(h - want) <= 1e-12 * want
    paths = torch.tensor(alignments_brute_force(T, C, target))
    s = path_scores(lp, 0, paths)
    naive = (s.logsumexp(0) - (s.softmax(0) * s).sum()).item()
    assert abs(naive - want) > 0.5 * want                  # cancellation: the naive formula loses every digit

# -- edge cases and bad inputs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize('backend', BACKENDS)
def test_empty_inputs_unbatched_and_infeasible(backend):
    lp = torch.randn(4, 3, 3, dtype=torch.float64).log_softmax(-1)
    tg, il, tl = torch.tensor([[1, 2], [0, 0], [1, 0]]), torch.tensor([0, 0, 4]), torch.tensor([2, 0, 0])
    h = alignment_entropy(lp, tg, il, tl, backend=backend)
    assert h.eq(0).all()                                    # infeasible, one empty alignment, one all-blank alignment
    labels, scores = kbest_alignments(lp, tg, il, tl, k=2, backend=backend)
    assert labels[:, 0].eq(-1).all() and scores[:, 0].eq(-math.inf).all()
    assert labels[0, 1].eq(0).all() and scores[0, 1] == 0 and scores[1, 1] == -math.inf     # the empty alignment
    assert labels[0, 2].eq(0).all() and scores[0, 2] == lp[:, 2, 0].sum() and labels[1, 2].eq(-1).all()
    labels, logp = sample_alignments(lp, tg, il, tl, n=4, backend=backend)
    assert labels[:, 0].eq(-1).all() and logp[:, 0].eq(-math.inf).all() and logp[:, 1:].eq(0).all()
    assert labels[:, 1:].eq(0).all()
    # unbatched (T, C) inputs, as ctc_loss takes them
    h1 = alignment_entropy(lp[:, 2], tg[2], 4, 0, backend=backend)
    assert h1.dim() == 0 and h1 == 0
    l1, s1 = kbest_alignments(lp[:, 0], tg[0, :1], 4, 1, k=3, backend=backend)
    assert l1.shape == (3, 4) and s1.shape == (3,)
    l2, p2 = sample_alignments(lp[:, 0], tg[0, :1], 4, 1, n=5, backend=backend)
    assert l2.shape == (5, 4) and p2.shape == (5,)
    close(alignment_entropy(lp[:, 0], tg[0, :1], 4, 1, backend=backend), alignment_entropy(lp[:, :1], tg[:1, :1], [4], [1], backend=backend)[0])

@pytest.mark.parametrize('backend', BACKENDS)
def test_concatenated_targets_and_float32(backend):
    lp, lq, tg, il, tl, targets = batch(6)
    concat = torch.tensor([c for t in targets for c in t])
    close(alignment_entropy(lp, concat, il, tl, backend=backend), alignment_entropy(lp, tg, il, tl, backend=backend))
    h32 = alignment_entropy(lp.float(), tg, il, tl, backend=backend)
    assert h32.dtype == torch.float32
    torch.testing.assert_close(h32.double(), alignment_entropy(lp, tg, il, tl, backend=backend), rtol=1e-5, atol=1e-6)

def expect(error, match, f, *args, **kw):
    with pytest.raises(error, match=match): f(*args, **kw)

def test_bad_inputs_are_clear_errors():
    lp = torch.randn(5, 2, 4).log_softmax(-1)
    tg, il, tl = torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 5]), torch.tensor([2, 1])
    for f in (alignment_entropy, kbest_alignments, sample_alignments):
        expect(ValueError, r'targets must hold labels in', f, lp, torch.tensor([[1, 7], [3, 0]]), il, tl)
        expect(ValueError, r'input_lengths must be in \[0, T\]', f, lp, tg, torch.tensor([6, 5]), tl)
        expect(ValueError, r'target_lengths must be >= 0', f, lp, tg, il, torch.tensor([-1, 1]))
        expect(ValueError, r'exceed the padded targets', f, lp, tg, il, torch.tensor([3, 1]))
        expect(ValueError, r'log_probs must have shape', f, lp[0, 0], tg, il, tl)
        expect(TypeError, r'targets must hold integer', f, lp, tg.float(), il, tl)
        expect(ValueError, r"backend must be", f, lp, tg, il, tl, backend='numba')
    for f in (alignment_kl, alignment_cross_entropy):
        expect(ValueError, r'same shape', f, lp, lp[:4], tg, il, tl)
        expect(ValueError, r"backend must be", f, lp, lp, tg, il, tl, backend='numba')
        expect(ValueError, r'targets must hold labels in', f, lp, lp, torch.tensor([[1, 7], [3, 0]]), il, tl)
    expect(ValueError, r'reduction must be', alignment_entropy, lp, tg, il, tl, reduction='avg')
    for k in (0, 17, 2.0, True): expect(ValueError, r'k must be an int in \[1, 16\]', kbest_alignments, lp, tg, il, tl, k=k)
    for n in (0, -1, 1.5): expect(ValueError, r'n must be a positive int', sample_alignments, lp, tg, il, tl, n=n)
    expect(TypeError, r'generator must be', sample_alignments, lp, tg, il, tl, generator=3)
    expect(ValueError, r'KMax.*k must be a positive int|k must be a positive int', KMax, 0)
    # the same messages as ctc_loss's
    with pytest.raises(ValueError) as ours: alignment_entropy(lp, torch.tensor([[1, 7], [3, 0]]), il, tl)
    with pytest.raises(ValueError) as loss: ctc_loss(lp, torch.tensor([[1, 7], [3, 0]]), il, tl)
    assert str(ours.value) == str(loss.value)

# -- the CPU kernels against the reference, at sizes enumeration cannot reach -----------------------------------------

def longer_batch(seed, T=40, N=6, C=7, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(T, N, C, generator=g, dtype=dtype).log_softmax(-1)
    lq = torch.randn(T, N, C, generator=g, dtype=dtype).log_softmax(-1)
    tg = torch.randint(1, C, (N, 12), generator=g)
    tg[1, 3] = tg[1, 2]                                                         # a repeat (no skip)
    il, tl = torch.tensor([40, 33, 40, 11, 25, 40]), torch.tensor([12, 10, 0, 12, 5, 1])   # one infeasible (3)
    return lp, lq, tg, il, tl

def test_cpu_kernels_agree_with_the_reference_values_and_gradients():
    lp, lq, tg, il, tl = longer_batch(0)
    for f, args in ((alignment_entropy, (lp,)), (alignment_kl, (lp, lq)), (alignment_cross_entropy, (lp, lq))):
        out = {}
        for backend in BACKENDS:
            xs = [a.detach().requires_grad_() for a in args]
            v = f(*xs, tg, il, tl, backend=backend)
            (v * torch.arange(1.0, 7.0, dtype=v.dtype)).sum().backward()          # a different weight per sequence
            out[backend] = (v.detach(), *[x.grad for x in xs])
        for a, b in zip(out['cpu'], out['reference']): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert out['cpu'][0][3] == 0 and out['cpu'][1][:, 3].eq(0).all()        # infeasible: 0, no gradient

def test_cpu_kbest_and_samples_equal_the_reference():
    lp, _, tg, il, tl = longer_batch(1)
    lc, sc = kbest_alignments(lp, tg, il, tl, k=16, backend='cpu')
    lr, sr = kbest_alignments(lp, tg, il, tl, k=16, backend='reference')
    assert torch.equal(lc, lr)
    torch.testing.assert_close(sc, sr, rtol=1e-12, atol=1e-12)
    a = sample_alignments(lp, tg, il, tl, n=64, generator=torch.Generator().manual_seed(3), backend='cpu')
    b = sample_alignments(lp, tg, il, tl, n=64, generator=torch.Generator().manual_seed(3), backend='reference')
    assert torch.equal(a[0], b[0])                                            # the same uniforms, the same samples
    torch.testing.assert_close(a[1], b[1], rtol=1e-10, atol=1e-10)

def test_cpu_kernels_in_float32_and_the_compute_dtype():
    lp, lq, tg, il, tl = longer_batch(2)
    h32 = alignment_entropy(lp.float(), tg, il, tl, backend='cpu')
    kl32 = alignment_kl(lp.float(), lq.float(), tg, il, tl, backend='cpu')
    assert h32.dtype == kl32.dtype == torch.float32
    torch.testing.assert_close(h32.double(), alignment_entropy(lp, tg, il, tl), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl32.double(), alignment_kl(lp, lq, tg, il, tl), rtol=1e-5, atol=1e-5)
    x = lp.half().detach().requires_grad_()
    alignment_entropy(x, tg, il, tl, backend='cpu').sum().backward()
    assert x.grad.dtype == torch.float16 and torch.isfinite(x.grad).all()

@pytest.mark.parametrize('peaky', [False, True])
def test_float32_kernels_match_float64_on_the_same_scores(peaky):
    "The float32 kernels' shorter polynomials (precise=False): values and gradients as float64's on the same numbers."
    lp, lq, tg, il, tl = longer_batch(4)
    if peaky: lp, lq = (lp * 40).log_softmax(-1), (lq * 40).log_softmax(-1)     # some entropies below 1e-9
    xs = [lp.float().detach().requires_grad_(), lq.float().detach().requires_grad_()]
    ys = [x.detach().double().requires_grad_() for x in xs]
    for f, args32, args64 in ((alignment_entropy, xs[:1], ys[:1]), (alignment_kl, xs, ys)):
        v32, v64 = f(*args32, tg, il, tl, backend='cpu'), f(*args64, tg, il, tl, backend='cpu')
        g32, g64 = torch.autograd.grad(v32.sum(), args32), torch.autograd.grad(v64.sum(), args64)
        if peaky and f is alignment_entropy: assert ((v64 > 0) & (v64 < 1e-9)).any()     # tiny: not log Z - E[score]
        torch.testing.assert_close(v32.double(), v64, rtol=1e-6, atol=0)
        for a, b in zip(g32, g64): torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-7)

def test_divergence_op_under_torch_compile():
    lp, lq, tg, il, tl = longer_batch(3, T=10, N=2, C=4)
    il, tl, tg = torch.tensor([10, 8]), torch.tensor([3, 2]), tg[:2, :3]
    f = torch.compile(lambda x: alignment_entropy(x, tg, il, tl, backend='cpu'), backend='eager', fullgraph=False)
    x = lp[:, :2].detach().requires_grad_()
    f(x).sum().backward()
    y = lp[:, :2].detach().requires_grad_()
    alignment_entropy(y, tg, il, tl, backend='cpu').sum().backward()
    torch.testing.assert_close(x.grad, y.grad)

def test_ctc_alignments_distribution_object():
    from seqdist.ctc import CTCAlignments
    lp, lq, tg, il, tl, targets = batch(7)
    d, e = CTCAlignments(lp, tg, il, tl), CTCAlignments(lq, tg, il, tl)
    close(d.entropy(), alignment_entropy(lp, tg, il, tl)); close(d.kl(e), alignment_kl(lp, lq, tg, il, tl))
    close(d.cross_entropy(e), alignment_cross_entropy(lp, lq, tg, il, tl))
    for b, target in enumerate(targets[:-1]):              # every alignment: log_prob sums to 1, matches enumeration
        T_b = int(il[b])
        paths = torch.tensor(alignments_brute_force(T_b, lp.shape[-1], target), dtype=torch.long).view(-1, T_b)
        value = torch.zeros(len(paths), lp.shape[1], lp.shape[0], dtype=torch.long)
        value[:, b, :T_b] = paths
        lpb = d.log_prob(value)[:, b]
        torch.testing.assert_close(lpb, path_scores(lp, b, paths).log_softmax(0), rtol=1e-10, atol=1e-12)
    bad = torch.zeros(lp.shape[1], lp.shape[0], dtype=torch.long); bad[0, :3] = torch.tensor([2, 1, 0])
    assert d.log_prob(bad)[0] == -math.inf                                  # collapses to [2, 1], not [1, 2]
    assert d.sample((3, 2)).shape == (3, 2, lp.shape[1], lp.shape[0])
    torch.testing.assert_close(d.marginals.sum(-1)[:, :5], (torch.arange(lp.shape[0])[:, None] < il[None, :5]).double())
    labels, scores = d.topk(2)
    assert torch.equal(labels[0, :-1], kbest_alignments(lp, tg, il, tl, k=1)[0][0, :-1])

# -- the CUDA kernel (ctc_divergence), through the emulator on CPU tensors

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_cuda_kernel_matches_the_cpu_kernel(dtype, monkeypatch):
    """Entropy, KL and cross-entropy and their gradients: the CUDA kernel (emulated) as the CPU kernel, in both dtypes;
    its two variants ($SEQDIST_CTC_DIVERGENCE split and fused) bitwise alike, also with 32 threads striding over the
    states."""
    lp, lq, tg, il, tl = longer_batch(5, dtype=dtype)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for f, xs in ((alignment_entropy, (lp,)), (alignment_kl, (lp, lq)), (alignment_cross_entropy, (lp, lq))):
        got = {}
        for backend, variant, threads in (('cpu', None, None), ('cuda', 'split', None), ('cuda', 'fused', None),
                                          ('cuda', 'split', 32), ('cuda', 'fused', 32)):
            ys = [x.detach().requires_grad_() for x in xs]
            if variant: monkeypatch.setenv('SEQDIST_CTC_DIVERGENCE', variant)
            with launch_limits(max_threads=threads): v = f(*ys, tg, il, tl, backend=backend)
            got[backend, variant, threads] = [v.detach(), *torch.autograd.grad(v.sum(), ys)]
        for key, values in got.items():
            for a, b in zip(got['cpu', None, None], values): torch.testing.assert_close(b, a, **tol)
            for a, b in zip(got['cuda', 'fused', None], values): assert key[0] == 'cpu' or torch.equal(a, b), key
    monkeypatch.setenv('SEQDIST_CTC_DIVERGENCE', 'both')
    with pytest.raises(ValueError, match="SEQDIST_CTC_DIVERGENCE must be 'split' or 'fused'"):
        alignment_entropy(lp.requires_grad_(), tg, il, tl, backend='cuda')

def test_cuda_kernel_on_the_enumerated_batch_and_gradcheck():
    "The emulated CUDA kernel against enumeration's batch (repeats, an empty target, infeasible targets), and gradcheck."
    lp, lq, tg, il, tl, _ = batch(8)
    for f, xs in ((alignment_entropy, (lp,)), (alignment_kl, (lp, lq))):
        close(f(*xs, tg, il, tl, backend='cuda'), f(*xs, tg, il, tl, backend='reference'), rtol=1e-10)
    x = lp[:4, :2].detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: alignment_entropy(x, tg[:2], [4, 4], tl[:2], backend='cuda'), (x,))
    for k in (1, 5, 16):                                            # k-best: the enumeration's, as the reference finds them
        (l1, s1), (l2, s2) = (kbest_alignments(lp, tg, il, tl, k=k, backend=b) for b in ('cuda', 'reference'))
        assert torch.equal(l1, l2)
        close(s1, s2)

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_cuda_kbest_matches_the_cpu_kernel(dtype):
    "k-best on the CUDA kernel (emulated): the CPU kernel's paths and scores, ties included (rounded scores)."
    lp, lq, tg, il, tl = longer_batch(7, dtype=dtype)
    for x in (lp, (lp * 2).round() / 2):                            # (the second: many exact ties)
        for k in (1, 4, 16):
            (l1, s1), (l2, s2) = (kbest_alignments(x, tg, il, tl, k=k, backend=b) for b in ('cuda', 'cpu'))
            assert torch.equal(l1, l2) and torch.equal(s1, s2)

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_cuda_sampler_gives_the_cpu_samples_and_gradients(dtype):
    """The same generator, the same samples on the CUDA kernel (emulated) as on the CPU and the reference; log-probabilities
    and their gradients (finite, an infeasible sequence included) as the reference's."""
    lp, lq, tg, il, tl = longer_batch(6, dtype=dtype)
    got = {}
    for backend in ('cpu', 'cuda', 'reference'):
        x = lp.detach().requires_grad_()
        labels, logp = sample_alignments(x, tg, il, tl, n=40, generator=torch.Generator().manual_seed(2), backend=backend)
        (grad,) = torch.autograd.grad(logp[torch.isfinite(logp)].sum(), x)
        got[backend] = labels, logp.detach(), grad
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for backend in ('cuda', 'cpu'):
        assert torch.equal(got[backend][0], got['reference'][0])
        torch.testing.assert_close(got[backend][1], got['reference'][1], **tol)
        assert torch.isfinite(got[backend][2]).all()
    torch.testing.assert_close(got['cuda'][2], got['cpu'][2], **tol)        # (the reference's float32 autograd: 2e-4 off)
    if dtype == torch.float64: torch.testing.assert_close(got['cpu'][2], got['reference'][2], **tol)

def test_fast_entropy_vouches_only_where_it_cannot_have_cancelled():
    """The expectation-semiring kernel (log Z - E[score]) keeps the sequences where its rounding bound is far below H and
    hands a peaky one (H tiny beside E[score]) and an empty target (H = 0) to the exact kernel; the mixed batch's
    entropies and gradients equal the reference's, in float64 and float32."""
    from seqdist.ctc import _fast_entropy, interleave_blanks
    g = torch.Generator().manual_seed(5)
    T, N, C, L = 30, 5, 6, 8
    lp = torch.randn(T, N, C, generator=g, dtype=torch.float64).log_softmax(-1)
    lp[:, 3] = (lp[:, 3] * 200).log_softmax(-1)            # sequence 3: one alignment almost certain
    tg, il, tl = torch.randint(1, C, (N, L), generator=g), torch.tensor([30, 25, 30, 30, 12]), torch.tensor([8, 5, 0, 8, 6])
    _, _, _, good = _fast_entropy(lp, interleave_blanks(tg, 0), il, tl, 0, False)
    assert good.tolist() == [True, True, False, False, True]
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        got = {}
        for backend in ('cpu', 'reference'):
            x = lp.to(dtype).requires_grad_()
            h = alignment_entropy(x, tg, il, tl, backend=backend)
            got[backend] = h.detach().double(), torch.autograd.grad((h * torch.arange(1.0, N + 1)).sum(), x)[0].double()
        assert 0 < got['cpu'][0][3] < 1e-6 * got['cpu'][0][0]
        for a, b in zip(got['cpu'], got['reference']): torch.testing.assert_close(a, b, rtol=tol, atol=tol)

@pytest.mark.parametrize('family', ['ctc', 'ctc_cuda', 'rnnt', 'tdt', 'crf'])
def test_divergence_gradients_scaled_in_place_survive_a_retained_graph(family):
    """Every family's entropy and KL ops hand their forward's gradient to the backward, which scales it in place (one
    buffer, as the losses hold): a second backward of the same graph (retain_graph) gets it computed again, so both
    backwards give the right gradient (the reference's, times each one's incoming gradient) and the first's result is
    not overwritten by the second."""
    from seqdist import rnnt, tdt
    from seqdist.crf import CTC_CRF
    g = torch.Generator().manual_seed(3)
    if family.startswith('ctc'):
        x, z = (torch.randn(7, 2, 5, generator=g, dtype=torch.float64).log_softmax(-1) for _ in range(2))
        args = (torch.tensor([[1, 2, 2], [3, 1, 0]]), torch.tensor([7, 6]), torch.tensor([3, 2]))
        backend = 'cuda' if family == 'ctc_cuda' else 'cpu'
        ent = lambda x, b: alignment_entropy(x, *args, backend=b)
        kl = lambda x, z, b: alignment_kl(x, z, *args, backend=b)
    elif family == 'crf':
        crf, backend = CTC_CRF(2, 'NACGT'), 'cpu'
        x, z = (torch.randn(6, 2, crf.n_score(), generator=g, dtype=torch.float64) for _ in range(2))
        ent, kl = (lambda x, b: crf.entropy(x, backend=b)), (lambda x, z, b: crf.kl(x, z, backend=b))
    else:
        mod, V = (rnnt, 5) if family == 'rnnt' else (tdt, 5 + 5)
        x, z = (torch.randn(2, 6, 4, V, generator=g, dtype=torch.float64) for _ in range(2))
        args, backend = (torch.tensor([[1, 2, 3], [2, 1, 0]]), torch.tensor([6, 5]), torch.tensor([3, 2])), 'cpu'
        ent = lambda x, b: mod.alignment_entropy(x, *args, backend=b)
        kl = lambda x, z, b: mod.alignment_kl(x, z, *args, backend=b)
    w = torch.tensor([1.5, -0.5], dtype=torch.float64)
    for f, inputs in ((lambda b, x, z: ent(x, b), (x,)), (lambda b, x, z: kl(x, z, b), (x, z))):
        ref = [t.clone().requires_grad_() for t in (x, z)]
        want = torch.autograd.grad(f('reference', *ref), ref[:len(inputs)], w)
        ours = [t.clone().requires_grad_() for t in (x, z)]
        value = f(backend, *ours)
        first = torch.autograd.grad(value, ours[:len(inputs)], w, retain_graph=True)
        kept = [t.clone() for t in first]
        second = torch.autograd.grad(value, ours[:len(inputs)], 2 * w)
        for a, k, b, r in zip(first, kept, second, want):
            torch.testing.assert_close(a, k, rtol=0, atol=0)
            torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(b, 2 * r, rtol=1e-9, atol=1e-11)
