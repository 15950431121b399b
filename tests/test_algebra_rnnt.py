"""Every question on the RNN-T lattice against enumeration of all its alignments: the semirings with components in
`logz_reference`, entropy, KL and cross-entropy (values and gradcheck), k-best alignments, exact samples (a chi-square
test and per-edge occupancy), a peaky case, variable and zero lengths, sequences without an alignment, bad inputs."""
import math, decimal, itertools
import pytest, torch
from sampling_checks import chi_square, chi_square_bound
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

@pytest.mark.parametrize('seed,blank', [(0, -1), (1, 0), (2, 2)])
def test_entropy_kl_cross_entropy_equal_enumeration(seed, blank):
    x, z, targets, il, tl = batch(seed, blank=blank)
    b_ = blank % x.shape[-1]
    h = alignment_entropy(x, targets, il, tl, blank)
    kl = alignment_kl(x, z, targets, il, tl, blank)
    ce = alignment_cross_entropy(x, z, targets, il, tl, blank)
    want = torch.tensor([exact(x, z, targets, b, int(il[b]), int(tl[b]), b_) for b in range(len(il))], dtype=torch.float64)
    for got, col in ((h, 0), (kl, 1), (ce, 2)):
        assert got.shape == (len(il),) and got.dtype == torch.float64
        torch.testing.assert_close(got, want[:, col], rtol=1e-10, atol=1e-14)
    assert h[2] == 0 and kl[2] == 0 and ce[2] == 0 and h[3] == 0      # no labels; one frame: one alignment each
    assert (alignment_kl(x, x, targets, il, tl, blank).abs() < 1e-15).all()     # KL(p || p) = 0
    close(alignment_cross_entropy(x, x, targets, il, tl, blank), h)
    close(ce, h + kl)
    # reduction as rnnt_loss's: 'mean' is the plain mean over the batch
    close(alignment_entropy(x, targets, il, tl, blank, reduction='sum'), h.sum())
    close(alignment_entropy(x, targets, il, tl, blank, reduction='mean'), h.mean())
    close(alignment_kl(x, z, targets, il, tl, blank, reduction='mean'), kl.mean())
    loss = rnnt_loss(x, targets, il.int(), tl.int(), blank, reduction='none')
    close(rnnt_loss(x, targets, il.int(), tl.int(), blank, reduction='mean'), loss.mean())

def test_uniform_model_has_the_entropy_of_a_uniform_choice():
    x = torch.zeros(2, 7, 4, 5, dtype=torch.float64)                 # every edge alike: every alignment alike
    h = alignment_entropy(x, torch.tensor([[1, 2, 3], [1, 1, 1]]), torch.tensor([7, 4]), torch.tensor([3, 2]))
    close(h, torch.tensor([math.log(math.comb(9, 3)), math.log(math.comb(5, 2))], dtype=torch.float64))

def test_without_log_softmax_and_float32():
    x, z, targets, il, tl = batch(3)
    lp = x.log_softmax(-1)
    close(alignment_entropy(lp, targets, il, tl, fused_log_softmax=False), alignment_entropy(x, targets, il, tl))
    h32 = alignment_entropy(x.float(), targets, il, tl)
    assert h32.dtype == torch.float32
    torch.testing.assert_close(h32.double(), alignment_entropy(x, targets, il, tl), rtol=1e-5, atol=1e-6)
    hh = alignment_entropy(x.half(), targets, il, tl)                   # half precision: computed in float32
    assert hh.dtype == torch.float32

def test_gradcheck_of_entropy_kl_and_cross_entropy():
    x, z, targets, il, tl = batch(1, T=3, U=2, V=3)
    x, z, targets, il, tl = x[:2].requires_grad_(), z[:2].requires_grad_(), targets[:2], il[:2], tl[:2]
    assert torch.autograd.gradcheck(lambda x: alignment_entropy(x, targets, il, tl), (x,), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, z: alignment_kl(x, z, targets, il, tl), (x, z), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, z: alignment_cross_entropy(x, z, targets, il, tl), (x, z), fast_mode=True)

# -- k-best -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('k', [1, 4, 16])
@pytest.mark.parametrize('seed', range(2))
def test_kbest_equals_the_sorted_enumeration(seed, k):
    x, _, targets, il, tl = batch(seed)
    B, T, U1, V = x.shape
    xg = x.detach().requires_grad_()
    frames, scores = kbest_alignments(xg, targets, il, tl, k=k)
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

def test_kbest_pads_and_does_not_track_gradients_it_was_not_asked_for():
    x = torch.randn(1, 3, 3, 4, dtype=torch.float64)
    frames, scores = kbest_alignments(x, torch.tensor([[1, 2]]), torch.tensor([3]), torch.tensor([2]), k=16)
    assert torch.isfinite(scores[:6]).all() and scores[6:].eq(-math.inf).all() and frames[6:].eq(-1).all()   # C(4, 2) = 6
    assert not scores.requires_grad and (scores[:-1] >= scores[1:]).all()
    assert len({tuple(f) for f in frames[:6, 0].tolist()}) == 6
    with torch.no_grad(): assert not kbest_alignments(x.requires_grad_(), torch.tensor([[1, 2]]), torch.tensor([3]), torch.tensor([2]), k=2)[1].requires_grad

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

def test_samples_match_the_exact_path_probabilities():
    x, _, targets, il, tl = batch(5, T=5, U=3)
    x = 0.5 * x                                                         # a flatter posterior: more paths with counts
    B, T, U1, V = x.shape
    n = 20000
    frames, logp = sample_alignments(x, targets, il, tl, n=n, generator=torch.Generator().manual_seed(0))
    assert frames.shape == (n, B, U1 - 1) and logp.shape == (n, B) and frames.dtype == torch.long
    for b in range(B):
        paths, s = scores_by_enumeration(x, targets, b, int(il[b]), int(tl[b]), V - 1)
        assert frames[:, b, tl[b]:].eq(-1).all()
        logprob = s.log_softmax(0)
        index = {tuple(p): i for i, p in enumerate(paths.tolist())}
        drawn = torch.tensor([index[tuple(p)] for p in frames[:, b, :tl[b]].tolist()])   # KeyError: not an alignment
        torch.testing.assert_close(logp[:, b], logprob[drawn], rtol=1e-10, atol=1e-12)
        if len(paths) == 1: continue
        counts = torch.bincount(drawn, minlength=len(paths)).double()
        stat, df = chi_square(counts, logprob.exp(), n)
        assert stat < chi_square_bound(df), (b, stat, df)
        # the test has power: the same counts fail against the probabilities shuffled, or the likeliest half as large again
        shuffled = logprob.exp()[torch.randperm(len(paths), generator=torch.Generator().manual_seed(b))]
        off = logprob.exp().clone(); off[off.argmax()] *= 1.5; off /= off.sum()
        assert chi_square(counts, shuffled, n)[0] > chi_square_bound(df) and chi_square(counts, off, n)[0] > chi_square_bound(df)
    # per-edge occupancy within 5 sigma of the edge posteriors (those of the CPU kernel, another implementation)
    freq = edge_occupancy(frames, il, tl, T, U1).mean(0)
    post = posteriors(x, targets, il, tl, backend='cpu')
    sigma = (post * (1 - post) / n).sqrt()
    assert ((freq - post).abs() <= 5 * sigma + 1e-12).all()
    assert (freq > 0).sum() > 40                                        # many edges tested, not only certain ones

def test_samples_are_reproducible_from_the_generator():
    x, _, targets, il, tl = batch(3)
    a = sample_alignments(x, targets, il, tl, n=50, generator=torch.Generator().manual_seed(7))
    b = sample_alignments(x, targets, il, tl, n=50, generator=torch.Generator().manual_seed(7))
    c = sample_alignments(x, targets, il, tl, n=50, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    torch.manual_seed(1); d = sample_alignments(x, targets, il, tl, n=50)
    torch.manual_seed(1); e = sample_alignments(x, targets, il, tl, n=50)
    assert torch.equal(d[0], e[0])
    # the uniforms are torch.rand((n, B, T + U - 1), float64) from the generator: the same draws, one step at a time
    u = torch.rand((50, 5, 5 + 3 - 1), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    from seqdist.rnnt import sample_frames
    y, il_, tl_ = clean_targets(x, targets, il, tl, x.shape[-1] - 1)
    bl, em = edge_log_probs(x, y, x.shape[-1] - 1)
    _, alphas = logz_reference(bl, em, il_, tl_, Log, all_nodes=True)
    assert torch.equal(sample_frames(alphas, bl, em, il_, tl_, u), a[0])

def test_sample_log_probabilities_are_differentiable():
    x, _, targets, il, tl = batch(4, T=3, U=2, V=3)
    x.requires_grad_()
    f = lambda x: sample_alignments(x, targets, il, tl, n=3, generator=torch.Generator().manual_seed(0))[1]
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

@pytest.mark.parametrize('sharpness', [4.0, 8.0, 32.0])
def test_entropy_of_a_peaky_model_is_accurate(sharpness):
    g = torch.Generator().manual_seed(0)
    T, U, V = 6, 3, 5
    logits = 0.3 * torch.randn(1, T, U + 1, V, generator=g, dtype=torch.float64)
    logits[..., V - 1] += 2                                  # blank, but for label u + 1 at node (2u, u)
    for u in range(U): logits[0, 2 * u, u, u + 1] += 4
    x = sharpness * logits
    targets = torch.tensor([[1, 2, 3]])
    h = alignment_entropy(x, targets, torch.tensor([T]), torch.tensor([U]))[0].item()
    want = entropy_high_precision(x, targets, 0, T, U, V - 1)
    assert abs(h - want) <= 1e-10 * want, (sharpness, h, want)
    if sharpness == 32.0: assert 1e-20 < want < 1e-9                   # tiny: cancellation would lose every digit

def test_entropy_of_a_two_path_lattice_in_closed_form():
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
    h = alignment_entropy(x, torch.tensor([[1]]), torch.tensor([2]), torch.tensor([1]))[0].item()
    assert 1e-13 < want < 1e-10 and abs(h - want) <= 1e-6 * want, (h, want)

# -- edge cases and bad inputs ----------------------------------------------------------------------------------------

def test_no_labels_one_frame_and_no_alignment():
    x = torch.randn(3, 4, 3, 4, dtype=torch.float64)
    targets, il, tl = torch.tensor([[1, 2], [1, 2], [1, 2]]), torch.tensor([4, 1, 4]), torch.tensor([0, 2, 2])
    # sequence 2: log-probabilities given directly (no log-softmax), its blank at the last frame impossible: no alignment
    lp = x.log_softmax(-1)
    lp[2, 3, :, 3] = -math.inf
    h = alignment_entropy(lp, targets, il, tl, fused_log_softmax=False)
    assert h.eq(0).all()
    frames, scores = kbest_alignments(lp, targets, il, tl, fused_log_softmax=False, k=2)
    assert frames[:, 0].eq(-1).all() and scores[0, 0] == lp[0, torch.arange(4), 0, 3].sum() and scores[1, 0] == -math.inf
    assert frames[0, 1].eq(0).all() and scores[1, 1] == -math.inf                       # one frame: both labels in it
    assert frames[:, 2].eq(-1).all() and scores[:, 2].eq(-math.inf).all()
    frames, logp = sample_alignments(lp, targets, il, tl, fused_log_softmax=False, n=4)
    assert frames[:, 0].eq(-1).all() and logp[:, 0].eq(0).all() and frames[:, 1].eq(0).all() and logp[:, 1].eq(0).all()
    assert frames[:, 2].eq(-1).all() and logp[:, 2].eq(-math.inf).all()
    # gradients stay finite, and zero for the sequence without an alignment
    xg = lp.detach().requires_grad_()
    (alignment_entropy(xg, targets, il, tl, fused_log_softmax=False).sum()
     + alignment_kl(xg, xg.flip(0), targets, il, tl, fused_log_softmax=False).sum()).backward()
    assert not xg.grad.isnan().any()
    # T = 1 and no labels: the single blank
    one = torch.randn(1, 1, 1, 3, dtype=torch.float64)
    f, s = kbest_alignments(one, torch.zeros(1, 0, dtype=torch.long), torch.tensor([1]), torch.tensor([0]), k=3)
    assert f.shape == (3, 1, 0) and s[0, 0] == one[0, 0, 0].log_softmax(-1)[2] and s[1:].eq(-math.inf).all()
    f, p = sample_alignments(one, torch.zeros(1, 0, dtype=torch.long), torch.tensor([1]), torch.tensor([0]), n=2)
    assert f.shape == (2, 1, 0) and p.eq(0).all()
    assert alignment_entropy(one, torch.zeros(1, 0, dtype=torch.long), torch.tensor([1]), torch.tensor([0])) == 0

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
        expect(NotImplementedError, r"no 'cpu' backend yet", f, x, tg, il, tl, backend='cpu')
        expect(NotImplementedError, r"no 'cuda' backend yet", f, x, tg, il, tl, backend='cuda')
        expect(ValueError, r"backend must be", f, x, tg, il, tl, backend='numba')
    for f in (alignment_kl, alignment_cross_entropy):
        expect(ValueError, r'same shape', f, x, x[:1], tg, il, tl)
        expect(ValueError, r'same shape', f, x, None, tg, il, tl)
        expect(NotImplementedError, r"no 'cpu' backend yet", f, x, x, tg, il, tl, backend='cpu')
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
