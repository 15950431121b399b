"""Every question on the RNN-T lattice against enumeration of all its alignments: the semirings with components in
`logz_reference`, entropy, KL and cross-entropy (values and gradcheck), k-best alignments, exact samples (a chi-square
test and per-edge occupancy), a peaky case, variable and zero lengths, sequences without an alignment, bad inputs."""
import math, decimal, itertools
import pytest, torch
from sampling_checks import chi_square, chi_square_bound, check_counts
from seqdist.core import Log, Max, Entropy, KL, CrossEntropy, KMax
from seqdist.rnnt import (edge_log_probs, clean_targets, logz_reference, logz_brute_force, posteriors, rnnt_loss,
                          best_path, alignment_entropy, alignment_kl, alignment_cross_entropy, kbest_alignments,
                          sample_alignments)

def close(a, b, rtol=1e-12): torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12)

# -- tiny lattices and their enumeration ------------------------------------------------------------------------------

def batch(seed, T=5, U=3, V=4, blank=-1):
    """Random fp64 logits of two models for a batch with variable lengths: full, shorter targets, no labels, one frame,
    and padding holding garbage (labels past each target length, logits past each length)."""
    g = torch.Generator().manual_seed(seed)
    B = 5
    x = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64)
    z = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64)
    b = blank % V
    labels = [c for c in range(V) if c != b]
    targets = torch.tensor(labels)[torch.randint(0, V - 1, (B, U), generator=g)]
    il, tl = torch.tensor([T, T - 1, T, 1, T - 2]), torch.tensor([U, U - 1, 0, 2, 1])
    targets[1, U - 1] = b                                             # garbage past the target length
    return x, z, targets, il, tl

def alignments(T_b, U_b):
    "Every alignment of U_b labels to T_b frames: the frame of each label, in order."
    return list(itertools.combinations_with_replacement(range(T_b), U_b))

def scores_by_enumeration(x, targets, b, T_b, U_b, blank):
    """The alignments of sequence b (M, U_b) and their summed log-probabilities (M,): each label u leaves node
    (its frame, u); the blank of frame t leaves (t, the number of labels emitted by frame t)."""
    lp = x[b].log_softmax(-1)
    y = targets[b].tolist()
    paths, scores = alignments(T_b, U_b), []
    for frames in paths:
        s = lp.new_zeros(())
        for u, t in enumerate(frames): s = s + lp[t, u, y[u]]
        for t in range(T_b): s = s + lp[t, sum(f <= t for f in frames), blank]
        scores.append(s)
    return torch.tensor(paths, dtype=torch.long).view(len(paths), U_b), torch.stack(scores)

def exact(x, z, targets, b, T_b, U_b, blank):
    "Entropy, KL and cross-entropy of sequence b by enumeration."
    _, sp = scores_by_enumeration(x, targets, b, T_b, U_b, blank)
    _, sq = scores_by_enumeration(z, targets, b, T_b, U_b, blank)
    a, q = sp.log_softmax(0), sq.log_softmax(0)
    p = a.exp()
    return -(p * a).sum().item(), (p * (a - q)).sum().item(), -(p * q).sum().item()

@pytest.mark.parametrize('S', [Entropy, KL, CrossEntropy, KMax(1), KMax(3), KMax(16)], ids=str)
def test_logz_reference_in_every_semiring_equals_brute_force(S):
    x, z, targets, il, tl = batch(0)
    V = x.shape[-1]
    y, il, tl = clean_targets(x, targets, il, tl, V - 1)
    two = S in (KL, CrossEntropy)
    (bp, ep), (bq, eq) = edge_log_probs(x, y, V - 1), edge_log_probs(z, y, V - 1)
    got = logz_reference(torch.stack([bp, bq]) if two else bp, torch.stack([ep, eq]) if two else ep, il, tl, S)
    assert got.shape == (S.components, x.shape[0])
    for b in range(x.shape[0]):
        lp = torch.stack([x[b], z[b]])[:, :il[b], :tl[b] + 1].log_softmax(-1)
        want = logz_brute_force(lp if two else lp[0], y[b, :tl[b]].tolist(), S)
        torch.testing.assert_close(got[:, b], want, rtol=1e-11, atol=1e-12)
    logz = logz_reference(bp, ep, il, tl, Log)
    close(got[0], logz) if not S.name.startswith('KMax') else close(got[0], logz_reference(bp, ep, il, tl, Max))

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
@pytest.mark.parametrize('seed,blank', [(0, -1), (1, 0), (2, 2)])
def test_entropy_kl_cross_entropy_equal_enumeration(seed, blank, backend):
    x, z, targets, il, tl = batch(seed, blank=blank)
    b_ = blank % x.shape[-1]
    h = alignment_entropy(x, targets, il, tl, blank, backend=backend)
    kl = alignment_kl(x, z, targets, il, tl, blank, backend=backend)
    ce = alignment_cross_entropy(x, z, targets, il, tl, blank, backend=backend)
    want = torch.tensor([exact(x, z, targets, b, int(il[b]), int(tl[b]), b_) for b in range(len(il))], dtype=torch.float64)
    for got, col in ((h, 0), (kl, 1), (ce, 2)):
        assert got.shape == (len(il),) and got.dtype == torch.float64
        torch.testing.assert_close(got, want[:, col], rtol=1e-10, atol=1e-14)
    assert h[2] == 0 and kl[2] == 0 and ce[2] == 0 and h[3] == 0      # no labels; one frame: one alignment each
    assert (alignment_kl(x, x, targets, il, tl, blank, backend=backend).abs() < 1e-15).all()     # KL(p || p) = 0
    close(alignment_cross_entropy(x, x, targets, il, tl, blank, backend=backend), h)
    close(ce, h + kl)
    # reduction as rnnt_loss's: 'mean' is the plain mean over the batch
    close(alignment_entropy(x, targets, il, tl, blank, reduction='sum', backend=backend), h.sum())
    close(alignment_entropy(x, targets, il, tl, blank, reduction='mean', backend=backend), h.mean())
    close(alignment_kl(x, z, targets, il, tl, blank, reduction='mean', backend=backend), kl.mean())
    loss = rnnt_loss(x, targets, il.int(), tl.int(), blank, reduction='none')
    close(rnnt_loss(x, targets, il.int(), tl.int(), blank, reduction='mean'), loss.mean())

@pytest.mark.parametrize('fused', [True, False])
def test_cuda_variants_give_the_same_bits(fused, monkeypatch):
    """The CUDA entropy and KL ($SEQDIST_RNNT_DIVERGENCE: split, the default, and fused; emulated): the same values and
    gradients bit for bit, with and without the fused log-softmax. A variant it does not know is refused."""
    x, z, targets, il, tl = batch(4)
    if not fused: x, z = x.log_softmax(-1), z.log_softmax(-1)
    got = {}
    for variant in ('split', 'fused'):
        monkeypatch.setenv('SEQDIST_RNNT_DIVERGENCE', variant)
        a, b = x.detach().requires_grad_(), z.detach().requires_grad_()
        h = alignment_entropy(a, targets, il, tl, fused_log_softmax=fused, backend='cuda')
        kl = alignment_kl(a, b, targets, il, tl, fused_log_softmax=fused, backend='cuda')
        w = torch.rand(len(il), generator=torch.Generator().manual_seed(0), dtype=h.dtype)
        got[variant] = [h.detach(), kl.detach(), *torch.autograd.grad((w * h).sum() + (w * kl).sum(), (a, b))]
    for u, v in zip(got['split'], got['fused']): assert torch.equal(u, v)
    assert got['split'][0].abs().gt(0.1).sum() >= 2                       # not a test of zeros
    monkeypatch.setenv('SEQDIST_RNNT_DIVERGENCE', 'both')
    with pytest.raises(ValueError, match="SEQDIST_RNNT_DIVERGENCE must be 'split' or 'fused'"):
        alignment_entropy(x.detach().requires_grad_(), targets, il, tl, backend='cuda')

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_uniform_model_has_the_entropy_of_a_uniform_choice(backend):
    x = torch.zeros(2, 7, 4, 5, dtype=torch.float64)                 # every edge alike: every alignment alike
    h = alignment_entropy(x, torch.tensor([[1, 2, 3], [1, 1, 1]]), torch.tensor([7, 4]), torch.tensor([3, 2]),
                          backend=backend)
    close(h, torch.tensor([math.log(math.comb(9, 3)), math.log(math.comb(5, 2))], dtype=torch.float64))

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_without_log_softmax_and_float32(backend):
    x, z, targets, il, tl = batch(3)
    lp = x.log_softmax(-1)
    H = lambda x, **kw: alignment_entropy(x, targets, il, tl, backend=backend, **kw)
    close(H(lp, fused_log_softmax=False), H(x))
    h32 = H(x.float())
    assert h32.dtype == torch.float32
    torch.testing.assert_close(h32.double(), H(x), rtol=1e-5, atol=1e-6)
    hh = H(x.half())                   # half precision: computed in float32
    assert hh.dtype == torch.float32

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_gradcheck_of_entropy_kl_and_cross_entropy(backend):
    x, z, targets, il, tl = batch(1, T=3, U=2, V=3)
    x, z, targets, il, tl = x[:2].requires_grad_(), z[:2].requires_grad_(), targets[:2], il[:2], tl[:2]
    kw = dict(backend=backend)
    assert torch.autograd.gradcheck(lambda x: alignment_entropy(x, targets, il, tl, **kw), (x,), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, z: alignment_kl(x, z, targets, il, tl, **kw), (x, z), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, z: alignment_cross_entropy(x, z, targets, il, tl, **kw), (x, z), fast_mode=True)

# -- k-best -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
@pytest.mark.parametrize('k', [1, 4, 16])
@pytest.mark.parametrize('seed', range(2))
def test_kbest_equals_the_sorted_enumeration(seed, k, backend):
    x, _, targets, il, tl = batch(seed)
    B, T, U1, V = x.shape
    xg = x.detach().requires_grad_()
    frames, scores = kbest_alignments(xg, targets, il, tl, k=k, backend=backend)
    assert frames.shape == (k, B, U1 - 1) and scores.shape == (k, B) and frames.dtype == torch.long
    for b in range(B):
        paths, s = scores_by_enumeration(x, targets, b, int(il[b]), int(tl[b]), V - 1)
        order = s.argsort(descending=True)[:k]
        m = len(order)
        torch.testing.assert_close(scores[:m, b].detach(), s[order], rtol=1e-12, atol=1e-12)
        assert torch.equal(frames[:m, b, :tl[b]], paths[order]) and frames[:m, b, tl[b]:].eq(-1).all()
        assert frames[m:, b].eq(-1).all() and scores[m:, b].eq(-math.inf).all()          # padding
    if k == 1:
        best_frames, best_score = best_path(x, targets, il, tl)
        assert torch.equal(frames[0], best_frames)
        close(scores[0].detach(), best_score)
    # the scores are differentiable: the gradient of the best score is that of its path's log-probability
    scores[0].sum().backward()
    want = torch.zeros_like(x)
    for b in range(B):
        lp = x[b].detach().requires_grad_()
        f, y = frames[0, b].tolist(), targets[b].tolist()
        s = sum(lp.log_softmax(-1)[t, u, y[u]] for u, t in enumerate(f[:tl[b]]))
        s = s + sum(lp.log_softmax(-1)[t, sum(0 <= f_ <= t for f_ in f), V - 1] for t in range(il[b]))
        want[b] = torch.autograd.grad(s, lp)[0]
    close(xg.grad, want)

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_kbest_pads_and_does_not_track_gradients_it_was_not_asked_for(backend):
    x = torch.randn(1, 3, 3, 4, dtype=torch.float64)
    frames, scores = kbest_alignments(x, torch.tensor([[1, 2]]), torch.tensor([3]), torch.tensor([2]), k=16, backend=backend)
    assert torch.isfinite(scores[:6]).all() and scores[6:].eq(-math.inf).all() and frames[6:].eq(-1).all()   # C(4, 2) = 6
    assert not scores.requires_grad and (scores[:-1] >= scores[1:]).all()
    assert len({tuple(f) for f in frames[:6, 0].tolist()}) == 6
    with torch.no_grad(): assert not kbest_alignments(x.requires_grad_(), torch.tensor([[1, 2]]), torch.tensor([3]), torch.tensor([2]), k=2, backend=backend)[1].requires_grad

# -- samples ------------------------------------------------------------------------------------------------------------

def edge_occupancy(frames, il, tl, T, U1):
    "Each sample's edges as 0/1 (n, B, T, U+1, 2): label u leaves (its frame, u), frame t's blank (t, labels emitted by t)."
    n, B, U = frames.shape
    t = torch.arange(T)
    label = (torch.arange(U) < tl[:, None])[None, :, None, :]                            # (1, B, 1, U)
    emits = (frames[:, :, None, :] == t[:, None]) & label                                # (n, B, T, U)
    emitted = ((frames[:, :, None, :] <= t[:, None]) & label).sum(-1)                    # (n, B, T)
    blanks = torch.nn.functional.one_hot(emitted, U1) * (t < il[:, None])[None, :, :, None]
    return torch.stack([blanks.double(), torch.nn.functional.pad(emits.double(), (0, U1 - U))], -1)

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_samples_match_the_exact_path_probabilities(backend):
    x, _, targets, il, tl = batch(5, T=5, U=3)
    x = 0.5 * x                                                         # a flatter posterior: more paths with counts
    B, T, U1, V = x.shape
    n = 20000
    frames, logp = sample_alignments(x, targets, il, tl, n=n, generator=torch.Generator().manual_seed(0), backend=backend)
    assert frames.shape == (n, B, U1 - 1) and logp.shape == (n, B) and frames.dtype == torch.long
    for b in range(B):
        paths, s = scores_by_enumeration(x, targets, b, int(il[b]), int(tl[b]), V - 1)
        assert frames[:, b, tl[b]:].eq(-1).all()
        logprob = s.log_softmax(0)
        index = {tuple(p): i for i, p in enumerate(paths.tolist())}
        drawn = torch.tensor([index[tuple(p)] for p in frames[:, b, :tl[b]].tolist()])   # KeyError: not an alignment
        torch.testing.assert_close(logp[:, b], logprob[drawn], rtol=1e-10, atol=1e-12)
        if len(paths) == 1: continue
        df = check_counts(drawn, logprob, n, b)
    # per-edge occupancy within 5 sigma of the edge posteriors (those of the CPU kernel, another implementation)
    freq = edge_occupancy(frames, il, tl, T, U1).mean(0)
    post = posteriors(x, targets, il, tl, backend='cpu')
    sigma = (post * (1 - post) / n).sqrt()
    assert ((freq - post).abs() <= 5 * sigma + 1e-12).all()
    assert (freq > 0).sum() > 40                                        # many edges tested, not only certain ones

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_samples_are_reproducible_from_the_generator(backend):
    x, _, targets, il, tl = batch(3)
    S = lambda **kw: sample_alignments(x, targets, il, tl, n=50, backend=backend, **kw)
    a, b, c = S(generator=torch.Generator().manual_seed(7)), S(generator=torch.Generator().manual_seed(7)), S(generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    torch.manual_seed(1); d = S()
    torch.manual_seed(1); e = S()
    assert torch.equal(d[0], e[0])
    # the uniforms are torch.rand((n, B, T + U - 1), float64) from the generator: the same draws, one step at a time
    u = torch.rand((50, 5, 5 + 3 - 1), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    from seqdist.rnnt import sample_frames
    y, il_, tl_ = clean_targets(x, targets, il, tl, x.shape[-1] - 1)
    bl, em = edge_log_probs(x, y, x.shape[-1] - 1)
    _, alphas = logz_reference(bl, em, il_, tl_, Log, all_nodes=True)
    assert torch.equal(sample_frames(alphas, bl, em, il_, tl_, u), a[0])

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_sample_log_probabilities_are_differentiable(backend):
    x, _, targets, il, tl = batch(4, T=3, U=2, V=3)
    x.requires_grad_()
    f = lambda x: sample_alignments(x, targets, il, tl, n=3, generator=torch.Generator().manual_seed(0), backend=backend)[1]
    assert torch.autograd.gradcheck(f, (x,), fast_mode=True)

# -- a peaky model: tiny entropy --------------------------------------------------------------------------------------

def entropy_high_precision(x, targets, b, T_b, U_b, blank, digits=60):
    "The entropy of sequence b's alignments by enumeration in decimal arithmetic with `digits` digits (every operation)."
    D = decimal.Decimal
    with decimal.localcontext() as ctx:
        ctx.prec = digits
        z = [[[D(v) for v in row] for row in col] for col in x[b].tolist()]            # fp64 values are exact
        lse = [[max(r) + sum(((v - max(r)).exp() for v in r), D(0)).ln() for r in col] for col in z]
        lp = lambda t, u, c: z[t][u][c] - lse[t][u]
        y = targets[b].tolist()
        scores = [sum((lp(t, u, y[u]) for u, t in enumerate(f)), D(0)) +
                  sum((lp(t, sum(f_ <= t for f_ in f), blank) for t in range(T_b)), D(0)) for f in alignments(T_b, U_b)]
        m = max(scores)
        logz = m + sum(((s - m).exp() for s in scores), D(0)).ln()
        return float(-sum((s - logz).exp() * (s - logz) for s in scores))

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
@pytest.mark.parametrize('sharpness', [4.0, 8.0, 32.0])
def test_entropy_of_a_peaky_model_is_accurate(sharpness, backend):
    g = torch.Generator().manual_seed(0)
    T, U, V = 6, 3, 5
    logits = 0.3 * torch.randn(1, T, U + 1, V, generator=g, dtype=torch.float64)
    logits[..., V - 1] += 2                                  # blank, but for label u + 1 at node (2u, u)
    for u in range(U): logits[0, 2 * u, u, u + 1] += 4
    x = sharpness * logits
    targets = torch.tensor([[1, 2, 3]])
    h = alignment_entropy(x, targets, torch.tensor([T]), torch.tensor([U]), backend=backend)[0].item()
    want = entropy_high_precision(x, targets, 0, T, U, V - 1)
    assert abs(h - want) <= 1e-10 * want, (sharpness, h, want)
    if sharpness == 32.0: assert 1e-20 < want < 1e-9                   # tiny: cancellation would lose every digit

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_entropy_of_a_two_path_lattice_in_closed_form(backend):
    # T = 2, one label: it leaves in frame 0 or in frame 1. With log-probabilities a (one path) and a - d (the other),
    # p = 1 / (1 + e^-d) and H = log(1 + e^-d) + d e^-d / (1 + e^-d), accurate by log1p for d large (H ~ 1e-12 at d ~ 31)
    x = torch.zeros(1, 2, 2, 3, dtype=torch.float64)
    x[0, 0, 0, 1] = 30.0                           # label in frame 0 very likely, then blanks
    lp = x[0].log_softmax(-1)
    first = lp[0, 0, 1] + lp[0, 1, 2] + lp[1, 1, 2]
    second = lp[0, 0, 2] + lp[1, 0, 1] + lp[1, 1, 2]
    d = (first - second).item()
    e = math.exp(-d)
    want = math.log1p(e) + d * e / (1 + e)
    h = alignment_entropy(x, torch.tensor([[1]]), torch.tensor([2]), torch.tensor([1]), backend=backend)[0].item()
    assert 1e-13 < want < 1e-10 and abs(h - want) <= 1e-6 * want, (h, want)

# -- edge cases and bad inputs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_no_labels_one_frame_and_no_alignment(backend):
    x = torch.randn(3, 4, 3, 4, dtype=torch.float64)
    targets, il, tl = torch.tensor([[1, 2], [1, 2], [1, 2]]), torch.tensor([4, 1, 4]), torch.tensor([0, 2, 2])
    # sequence 2: log-probabilities given directly (no log-softmax), its blank at the last frame impossible: no alignment
    lp = x.log_softmax(-1)
    lp[2, 3, :, 3] = -math.inf
    h = alignment_entropy(lp, targets, il, tl, fused_log_softmax=False, backend=backend)
    assert h.eq(0).all()
    frames, scores = kbest_alignments(lp, targets, il, tl, fused_log_softmax=False, k=2, backend=backend)
    assert frames[:, 0].eq(-1).all() and scores[0, 0] == lp[0, torch.arange(4), 0, 3].sum() and scores[1, 0] == -math.inf
    assert frames[0, 1].eq(0).all() and scores[1, 1] == -math.inf                       # one frame: both labels in it
    assert frames[:, 2].eq(-1).all() and scores[:, 2].eq(-math.inf).all()
    frames, logp = sample_alignments(lp, targets, il, tl, fused_log_softmax=False, n=4, backend=backend)
    assert frames[:, 0].eq(-1).all() and logp[:, 0].eq(0).all() and frames[:, 1].eq(0).all() and logp[:, 1].eq(0).all()
    assert frames[:, 2].eq(-1).all() and logp[:, 2].eq(-math.inf).all()
    # gradients stay finite, and zero for the sequence without an alignment
    xg = lp.detach().requires_grad_()
    (alignment_entropy(xg, targets, il, tl, fused_log_softmax=False, backend=backend).sum()
     + alignment_kl(xg, xg.flip(0), targets, il, tl, fused_log_softmax=False, backend=backend).sum()).backward()
    assert not xg.grad.isnan().any()
    # T = 1 and no labels: the single blank
    one = torch.randn(1, 1, 1, 3, dtype=torch.float64)
    f, s = kbest_alignments(one, torch.zeros(1, 0, dtype=torch.long), torch.tensor([1]), torch.tensor([0]), k=3, backend=backend)
    assert f.shape == (3, 1, 0) and s[0, 0] == one[0, 0, 0].log_softmax(-1)[2] and s[1:].eq(-math.inf).all()
    f, p = sample_alignments(one, torch.zeros(1, 0, dtype=torch.long), torch.tensor([1]), torch.tensor([0]), n=2, backend=backend)
    assert f.shape == (2, 1, 0) and p.eq(0).all()
    assert alignment_entropy(one, torch.zeros(1, 0, dtype=torch.long), torch.tensor([1]), torch.tensor([0]), backend=backend) == 0

def expect(error, match, f, *args, **kw):
    with pytest.raises(error, match=match): f(*args, **kw)

def test_bad_inputs_are_clear_errors():
    x = torch.randn(2, 5, 3, 4)
    tg, il, tl = torch.tensor([[1, 2], [0, 1]], dtype=torch.int32), torch.tensor([5, 5]), torch.tensor([2, 1])
    for f in (alignment_entropy, kbest_alignments, sample_alignments):
        expect(ValueError, r'targets must hold labels in|labels', f, x, torch.tensor([[1, 7], [0, 1]]), il, tl)
        expect(ValueError, r'logit_lengths must be in \[1, T\]', f, x, tg, torch.tensor([6, 5]), tl)
        expect(ValueError, r'logit_lengths must be in \[1, T\]', f, x, tg, torch.tensor([0, 5]), tl)
        expect(ValueError, r'target_lengths must be in', f, x, tg, il, torch.tensor([3, 1]))
        expect(ValueError, r'logits must have shape', f, x[0], tg, il, tl)
        expect(TypeError, r'targets must hold integers', f, x, tg.float(), il, tl)
        expect(ValueError, r"backend must be", f, x, tg, il, tl, backend='numba')
    for f in (alignment_kl, alignment_cross_entropy):
        expect(ValueError, r'same shape', f, x, x[:1], tg, il, tl)
        expect(ValueError, r'same shape', f, x, None, tg, il, tl)
        expect(ValueError, r'labels', f, x, x, torch.tensor([[1, 7], [0, 1]]), il, tl)
        expect(ValueError, r'reduction must be', f, x, x, tg, il, tl, reduction='avg')
    expect(ValueError, r'reduction must be', alignment_entropy, x, tg, il, tl, reduction='avg')
    for k in (0, 17, 2.0, True): expect(ValueError, r'k must be an int in \[1, 16\]', kbest_alignments, x, tg, il, tl, k=k)
    for n in (0, -1, 1.5): expect(ValueError, r'n must be a positive int', sample_alignments, x, tg, il, tl, n=n)
    expect(TypeError, r'generator must be', sample_alignments, x, tg, il, tl, generator=3)
    # the same messages as rnnt_loss's
    for bad in ((x, torch.tensor([[1, 3], [0, 1]]), il, tl), (x, tg, torch.tensor([6, 5]), tl)):
        with pytest.raises(ValueError) as ours: alignment_entropy(*bad)
        with pytest.raises(ValueError) as loss: rnnt_loss(*bad)
        assert str(ours.value) == str(loss.value)

# -- the CPU kernels against the reference, at sizes enumeration cannot reach -----------------------------------------

def larger(seed, B=4, T=40, U=15, V=9, dtype=torch.float64):
    "Two models' logits for a batch past enumeration (C(54, 15) ~ 1e13 alignments), variable lengths, a zero-length target."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, U + 1, V, generator=g, dtype=dtype)
    z = x + 0.5 * torch.randn(B, T, U + 1, V, generator=g, dtype=dtype)
    targets = torch.randint(0, V - 1, (B, U), generator=g)
    return x, z, targets, torch.tensor([T, T - 7, 1, T - 3])[:B], torch.tensor([U, U - 4, 0, 9])[:B]

def test_cpu_kernels_agree_with_the_reference_values_and_gradients():
    x, z, targets, il, tl = larger(0)
    for f, inputs in ((alignment_entropy, (x,)), (alignment_kl, (x, z)), (alignment_cross_entropy, (x, z))):
        got = []
        for backend in ('cpu', 'reference'):
            xs = [t.detach().requires_grad_() for t in inputs]
            v = f(*xs, targets, il, tl, backend=backend)
            w = torch.linspace(0.5, 2.0, len(v), dtype=v.dtype)               # a different weight per sequence
            got.append((v.detach(), torch.autograd.grad((w * v).sum(), xs)))
        (v_cpu, g_cpu), (v_ref, g_ref) = got
        torch.testing.assert_close(v_cpu, v_ref, rtol=1e-10, atol=1e-12)
        for a, b in zip(g_cpu, g_ref): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert v_cpu[2] == 0                                                   # no labels: one alignment
    # 'auto' on CPU tensors is the kernel, bit for bit; and without log-softmax (log-probabilities given)
    assert torch.equal(alignment_entropy(x, targets, il, tl), alignment_entropy(x, targets, il, tl, backend='cpu'))
    lp = x.log_softmax(-1).requires_grad_()
    a = alignment_kl(lp, z.log_softmax(-1), targets, il, tl, fused_log_softmax=False, backend='cpu')
    b = alignment_kl(lp, z.log_softmax(-1), targets, il, tl, fused_log_softmax=False, backend='reference')
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(a.sum(), lp)[0], torch.autograd.grad(b.sum(), lp)[0], rtol=1e-10, atol=1e-12)

def test_cpu_kernels_in_float32():
    x, z, targets, il, tl = larger(1, dtype=torch.float32)
    x.requires_grad_()
    h = alignment_entropy(x, targets, il, tl, backend='cpu')
    assert h.dtype == torch.float32
    g, = torch.autograd.grad(h.sum(), x)
    assert g.dtype == torch.float32
    xd = x.detach().double().requires_grad_()
    want = alignment_entropy(xd, targets, il, tl, backend='reference')
    torch.testing.assert_close(h.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g.double(), torch.autograd.grad(want.sum(), xd)[0], rtol=1e-5, atol=1e-6)
    kl = alignment_kl(x, z, targets, il, tl, backend='cpu')
    torch.testing.assert_close(kl.double(), alignment_kl(x.double(), z.double(), targets, il, tl, backend='reference'),
                               rtol=1e-5, atol=1e-6)
    f, s = kbest_alignments(x, targets, il, tl, k=4, backend='cpu')
    f_ref, s_ref = kbest_alignments(x.double(), targets, il, tl, k=4, backend='reference')
    assert s.dtype == torch.float32 and torch.equal(f, f_ref)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-5, atol=1e-4)

def test_cpu_kbest_and_samples_equal_the_reference():
    x, _, targets, il, tl = larger(2)
    for k in (1, 5):
        xs = [x.detach().requires_grad_() for _ in range(2)]
        (f_cpu, s_cpu), (f_ref, s_ref) = (kbest_alignments(xi, targets, il, tl, k=k, backend=b)
                                          for xi, b in zip(xs, ('cpu', 'reference')))
        assert torch.equal(f_cpu, f_ref)
        torch.testing.assert_close(s_cpu, s_ref, rtol=1e-12, atol=1e-12)
        (g_cpu,), (g_ref,) = (torch.autograd.grad(s.sum(), xi) for s, xi in ((s_cpu, xs[0]), (s_ref, xs[1])))
        torch.testing.assert_close(g_cpu, g_ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(kbest_alignments(x, targets, il, tl, k=1, backend='cpu')[0][0], best_path(x, targets, il, tl)[0])
    xs = [x.detach().requires_grad_() for _ in range(2)]
    (f_cpu, p_cpu), (f_ref, p_ref) = (sample_alignments(xi, targets, il, tl, n=16, generator=torch.Generator().manual_seed(3),
                                                        backend=b) for xi, b in zip(xs, ('cpu', 'reference')))
    assert torch.equal(f_cpu, f_ref) and len({tuple(f) for f in f_cpu[:, 0].tolist()}) > 1
    torch.testing.assert_close(p_cpu, p_ref, rtol=1e-10, atol=1e-10)
    (g_cpu,), (g_ref,) = (torch.autograd.grad(p.sum(), xi) for p, xi in ((p_cpu, xs[0]), (p_ref, xs[1])))
    torch.testing.assert_close(g_cpu, g_ref, rtol=1e-10, atol=1e-12)

def test_zero_length_targets_on_the_cpu():
    x = torch.randn(2, 6, 1, 4, dtype=torch.float64, requires_grad=True)      # U = 0: the all-blank path alone
    targets, il, tl = torch.zeros(2, 0, dtype=torch.long), torch.tensor([6, 3]), torch.tensor([0, 0])
    h = alignment_entropy(x, targets, il, tl, backend='cpu')
    assert h.eq(0).all() and torch.autograd.grad(h.sum(), x)[0].abs().max() < 1e-14       # (rounding: log mu = 0 to 1 ulp)
    f, s = kbest_alignments(x, targets, il, tl, k=2, backend='cpu')
    assert f.shape == (2, 2, 0) and s[1].eq(-math.inf).all()
    close(s[0].detach(), -rnnt_loss(x.detach(), targets, il, tl, reduction='none'))
    f, p = sample_alignments(x, targets, il, tl, n=3, backend='cpu')
    assert f.shape == (3, 2, 0) and p.abs().max() < 1e-13                  # log 1, to rounding

def test_compiled_entropy_on_the_cpu_equals_eager():
    x, z, targets, il, tl = larger(3, B=2, T=9, U=4)
    f = lambda x: alignment_entropy(x, targets, il, tl, backend='cpu')
    xs = [x.detach().requires_grad_() for _ in range(2)]
    eager, compiled = f(xs[0]), torch.compile(f, backend='eager', fullgraph=True)(xs[1])
    close(compiled, eager)
    close(torch.autograd.grad(compiled.sum(), xs[1])[0], torch.autograd.grad(eager.sum(), xs[0])[0])

# -- the distribution object ------------------------------------------------------------------------------------------

def test_rnnt_alignments_object_against_enumeration_and_the_functions():
    """RNNTAlignments: log_prob sums to 1 over every alignment (enumerated) and gives their entropy; frames that are not an
    alignment get -inf; samples' log_prob is sample_alignments' log-probability; the other names are the functions'."""
    from seqdist.rnnt import RNNTAlignments, best_path, sample_alignments
    g = torch.Generator().manual_seed(4)
    T, U = 5, 2
    x = torch.randn(2, T, U + 1, 4, generator=g, dtype=torch.float64)
    xq = torch.randn(2, T, U + 1, 4, generator=g, dtype=torch.float64)
    y, il, tl = torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 4]), torch.tensor([2, 1])
    d, dq = RNNTAlignments(x, y, il, tl, blank=0), RNNTAlignments(xq, y, il, tl, blank=0)
    first = [[a, b] for a, b in itertools.combinations_with_replacement(range(5), 2)]
    second = [[c, -1] for c in range(4)] + [[0, 0]] * 11
    p = d.log_prob(torch.tensor([first, second]).transpose(0, 1)).exp()
    close(p.sum(0), torch.ones(2, dtype=torch.float64))
    close(d.entropy(), -(p * p.log()).nan_to_num().sum(0))
    q = dq.log_prob(torch.tensor([first, second]).transpose(0, 1)).exp()
    close(d.kl(dq), (p * (p.log() - q.log())).nan_to_num().sum(0))
    close(d.cross_entropy(dq), -(p * q.log()).nan_to_num().sum(0))
    bad = torch.tensor([[[2, 1], [0, -1]], [[0, 5], [0, -1]], [[0, 1], [4, -1]], [[0, 1], [1, 2]], [[-1, 1], [0, -1]]])
    lp = d.log_prob(bad)
    assert torch.isinf(lp[:, 0]).tolist() == [True, True, False, False, True]       # decreasing, past T, -, -, negative
    assert torch.isinf(lp[:, 1]).tolist() == [False, False, True, True, False]      # -, -, frame 4 >= T_b = 4, not -1 past U_b
    frames, logp = sample_alignments(x, y, il, tl, blank=0, n=6, generator=torch.Generator().manual_seed(3))
    close(d.log_prob(frames), logp)
    assert torch.equal(d.sample((2, 3), generator=torch.Generator().manual_seed(3)), frames.reshape(2, 3, 2, 2))
    assert torch.equal(d.argmax, best_path(x, y, il, tl, blank=0)[0])
    top, scores = d.topk(4)
    close(d.log_prob(top), scores - d.log_partition)
    close(d.marginals.sum((1, 2)), torch.tensor([[5.0, 2.0], [4.0, 1.0]], dtype=torch.float64))   # T_b blanks, U_b labels
    with pytest.raises(ValueError, match='value must have shape'):
        d.log_prob(torch.zeros(3, 2, 3, dtype=torch.long))
