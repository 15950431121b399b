"""Every question on the TDT and multi-blank lattices against an independent enumeration of their paths: entropy, KL and
cross-entropy (values and gradcheck), k-best alignments, exact samples (a chi-square test and per-edge occupancy),
reproducibility, a peaky case, variable lengths, infeasible targets, bad inputs; and the semirings through
`logz_reference`."""
import math, decimal
import pytest, torch
from sampling_checks import chi_square, chi_square_bound, check_counts
from seqdist.core import Log, Max, Entropy, KL, CrossEntropy, KMax
from seqdist.rnnt import clean_targets
from seqdist.tdt import (edge_table, edge_scores, logz_reference, tdt_alignments, multiblank_alignments,
                         alignment_entropy, alignment_kl, alignment_cross_entropy, kbest_alignments, sample_alignments,
                         multiblank_alignment_entropy, multiblank_alignment_kl, multiblank_alignment_cross_entropy,
                         multiblank_kbest_alignments, multiblank_sample_alignments)

# -- the two lattices, enumerated from their definitions ---------------------------------------------------------------

def tdt_paths(T, U, durations):
    """Every TDT path with T frames and U labels, as a tuple of edges (t, u, label?, duration index): a blank of duration
    d >= 1 moves (t, u) -> (t + d, u), landing before T or exactly on T at u = U; a label moves (t, u) -> (t + d, u + 1)
    with t + d < T."""
    out = []
    def walk(t, u, path):
        if t == T: out.append(tuple(path)); return
        for i, d in enumerate(durations):
            if d > 0 and (t + d < T or (t + d == T and u == U)): walk(t + d, u, path + [(t, u, 0, i)])
            if u < U and t + d < T: walk(t + d, u + 1, path + [(t, u, 1, i)])
    walk(0, 0, [])
    return out

def multiblank_paths(T, U, big):
    """Every multi-blank path, as a tuple of edges (t, u, label?, blank index j: 0 the blank (1 frame), 1 + i big blank
    i): a label stays in its frame; blank j moves its duration, landing before T or on T at u = U."""
    blanks = [1] + list(big)
    out = []
    def walk(t, u, path):
        if t == T: out.append(tuple(path)); return
        for j, d in enumerate(blanks):
            if t + d < T or (t + d == T and u == U): walk(t + d, u, path + [(t, u, 0, j)])
        if u < U: walk(t, u + 1, path + [(t, u, 1, -1)])
    walk(0, 0, [])
    return out

class Lattice:
    "One of the two lattices with its arguments: the public functions, the paths of a sequence, their scores and timestamps."
    def __init__(self, kind, spec, blank=-1, sigma=0.0):
        self.kind, self.spec, self.blank, self.sigma = kind, tuple(spec), blank, sigma
        self.tdt = kind == 'tdt'
        f = ((alignment_entropy, alignment_kl, alignment_cross_entropy, kbest_alignments, sample_alignments) if self.tdt else
             (multiblank_alignment_entropy, multiblank_alignment_kl, multiblank_alignment_cross_entropy,
              multiblank_kbest_alignments, multiblank_sample_alignments))
        kw = dict(blank=blank, sigma=sigma)
        self.entropy = lambda x, *a, **k: f[0](x, *a, self.spec, **kw, **k)
        self.kl = lambda p, q, *a, **k: f[1](p, q, *a, self.spec, **kw, **k)
        self.ce = lambda p, q, *a, **k: f[2](p, q, *a, self.spec, **kw, **k)
        self.kbest = lambda x, *a, **k: f[3](x, *a, self.spec, **kw, **k)
        self.sample = lambda x, *a, **k: f[4](x, *a, self.spec, **kw, **k)
    def __repr__(self): return f"{self.kind}{self.spec}"

    def V(self, x): return x.shape[-1] - (len(self.spec) if self.tdt else 0)

    def paths(self, T_b, U_b): return tdt_paths(T_b, U_b, self.spec) if self.tdt else multiblank_paths(T_b, U_b, self.spec)

    def scores(self, x, y, paths):
        "The score (M,) of each path of one sequence: x (T, U+1, W) its logits (differentiable), y its labels."
        V = self.V(x)
        blank = self.blank % V
        tok = x[..., :V].log_softmax(-1) - self.sigma
        dur = x[..., V:].log_softmax(-1)
        def edge(t, u, label, i):
            if self.tdt: return tok[t, u, y[u] if label else blank] + dur[t, u, i]
            return tok[t, u, y[u] if label else (blank if i == 0 else blank - i)]
        return torch.stack([sum(edge(*e) for e in p) for p in paths]) if paths else x.new_zeros(0)

    def timestamps(self, path, T_b, U_b):
        "A path's labels' frames and durations and each frame's blank duration (0: none), as one hashable key."
        frames, durs, blanks = [-1] * U_b, [-1] * U_b, [0] * T_b
        for t, u, label, i in path:
            d = self.spec[i] if self.tdt else ([1] + list(self.spec))[i] if not label else 0
            if label: frames[u], durs[u] = t, d
            else: blanks[t] = d
        return tuple(frames), tuple(durs), tuple(blanks)

TDT, TDT_NO_ZERO, MULTIBLANK = Lattice('tdt', (0, 1, 2), sigma=0.1), Lattice('tdt', (1, 2), blank=0), Lattice('multiblank', (2, 3))
LATTICES = [TDT, TDT_NO_ZERO, MULTIBLANK]

def batch(lat, seed, scale=1.0):
    """Random fp64 logits p and q (B, T, U+1, W) for sequences of variable lengths (an empty target, shorter inputs; for
    durations without 0, last, one whose labels cannot fit its frames), targets with garbage padding, the lengths."""
    g = torch.Generator().manual_seed(seed)
    T, U, V = 5, 3, 6
    il, tl = [5, 5, 4, 3, 2], [3, 0, 2, 1, 2]
    W = V + (len(lat.spec) if lat.tdt else 0)
    x = torch.randn(2, len(il), T, U + 1, W, generator=g, dtype=torch.float64) * scale
    blank = lat.blank % V
    labels = [c for c in range(V) if c != blank and not (not lat.tdt and blank - len(lat.spec) <= c < blank)]
    y = torch.tensor(labels)[torch.randint(0, len(labels), (len(il), U), generator=g)]
    y = torch.where(torch.arange(U) < torch.tensor(tl)[:, None], y, 99)          # padding: garbage
    return x[0], x[1], y, torch.tensor(il), torch.tensor(tl)

def exact(lat, x, xq, y, b, T_b, U_b):
    "Entropy, KL and cross-entropy of sequence b by enumeration, 0 if it has no path."
    paths = lat.paths(T_b, U_b)
    if not paths: return 0.0, 0.0, 0.0
    p = lat.scores(x[b], y[b], paths).log_softmax(0)
    q = lat.scores(xq[b], y[b], paths).log_softmax(0)
    return -(p.exp() * p).sum().item(), (p.exp() * (p - q)).sum().item(), -(p.exp() * q).sum().item()

@pytest.fixture(autouse=True)
def _one_thread():
    "Tiny lattices: one thread is faster than two on a shared machine (no thread hand-offs on each small operation)."
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

def close(a, b, rtol=1e-12): torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12)

# -- entropy, KL, cross-entropy ----------------------------------------------------------------------------------------

@pytest.mark.parametrize('lat', LATTICES, ids=repr)
def test_entropy_kl_cross_entropy_equal_enumeration(lat):
    for seed in range(2):
        x, xq, y, il, tl = batch(lat, seed)
        h, kl, ce = lat.entropy(x, y, il, tl), lat.kl(x, xq, y, il, tl), lat.ce(x, xq, y, il, tl)
        want = torch.tensor([exact(lat, x, xq, y, b, int(il[b]), int(tl[b])) for b in range(len(il))], dtype=torch.float64)
        for got, col in ((h, 0), (kl, 1), (ce, 2)):
            torch.testing.assert_close(got, want[:, col], rtol=1e-10, atol=1e-14)
        assert (want[:, 0] > 0).sum() >= 4                                    # not a test of zeros
        assert lat.kl(x, x, y, il, tl).eq(0).all()                             # KL(p || p) is exactly 0
        close(lat.ce(x, x, y, il, tl), h)
        close(lat.entropy(x, y, il, tl, reduction='sum'), h.sum())
        close(lat.entropy(x, y, il, tl, reduction='mean'), h.mean())            # tdt_loss's reductions
        close(lat.kl(x, xq, y, il, tl, reduction='mean_volume'), kl.sum() / tl.sum())
    if lat is TDT_NO_ZERO: assert h[-1] == 0 and kl[-1] == 0 and ce[-1] == 0   # no path

@pytest.mark.parametrize('lat', [TDT, MULTIBLANK], ids=repr)
def test_the_semirings_through_logz_reference(lat):
    x, xq, y, il, tl = batch(lat, 3)
    V = lat.V(x)
    blank = lat.blank % V
    yc, ilc, tlc = clean_targets(x[..., :V], y, il, tl, blank)
    table = edge_table(lat.spec if lat.tdt else (), () if lat.tdt else lat.spec, blank, False)
    dlp = lambda z: z[..., V:].log_softmax(-1) if lat.tdt else None
    p = edge_scores(x[..., :V].log_softmax(-1), dlp(x), yc, table)
    q = edge_scores(xq[..., :V].log_softmax(-1), dlp(xq), yc, table)
    logz, best = logz_reference(p, table, ilc, tlc, Log), logz_reference(p, table, ilc, tlc, Max)
    close(logz_reference(p, table, ilc, tlc, Entropy)[0], logz)
    both = logz_reference(torch.stack([p, q]), table, ilc, tlc, KL)
    close(both[0], logz); close(both[1], logz_reference(q, table, ilc, tlc, Log))
    assert torch.equal(logz_reference(p, table, ilc, tlc, KMax(1))[0], best)
    close(logz_reference(p, table, ilc, tlc, KMax(5))[0], best)
    z, diagonals = logz_reference(p, table, ilc, tlc, Log, all_diagonals=True)
    assert torch.equal(z, logz) and diagonals.shape == (x.shape[1] + x.shape[2], *logz.shape, x.shape[2])

@pytest.mark.parametrize('lat', LATTICES, ids=repr)
def test_gradcheck_of_entropy_kl_and_cross_entropy(lat):
    """Two sequences (3 frames and 1 label; 2 frames and none), one label token: the full Jacobian of the entropy; for
    KL and cross-entropy, gradcheck's fast mode (random projections of it), for time."""
    g = torch.Generator().manual_seed(4)
    W = 3 + len(lat.spec) if lat.tdt else 2 + len(lat.spec)                 # (multi-blank: a label, big blanks, blank)
    x, xq = (torch.randn(2, 3, 2, W, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    y, il, tl = torch.full((2, 1), 1 if lat.tdt else 0), torch.tensor([3, 2]), torch.tensor([1, 0])
    assert torch.autograd.gradcheck(lambda x: lat.entropy(x, y, il, tl), (x,))
    assert torch.autograd.gradcheck(lambda x, q: lat.kl(x, q, y, il, tl), (x, xq), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, q: lat.ce(x, q, y, il, tl), (x, xq), fast_mode=True)

def weighted(out, seed):
    "A random weighting of the outputs: the gradient of their weighted sum tests the whole Jacobian's rows at once."
    return (out * torch.rand(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)).sum()

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
@pytest.mark.parametrize('lat', LATTICES, ids=repr)
def test_cpu_kernels_equal_the_reference(lat, backend):
    """The CPU kernels and the CUDA kernels (emulated; the backward in closed form, in the same call) against the
    reference (autograd through the recursion): values and gradients, fp64, variable lengths and a sequence with no path."""
    for seed in range(2):
        x, xq, y, il, tl = batch(lat, 20 + seed)
        x, xq = x.requires_grad_(), xq.requires_grad_()
        cases = [('entropy', lat.entropy, (x,)), ('KL', lat.kl, (x, xq)), ('cross-entropy', lat.ce, (x, xq))]
        for name, f, args in cases:
            got, want = (f(*args, y, il, tl, backend=b) for b in (backend, 'reference'))
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")
            g_got = torch.autograd.grad(weighted(got, seed), args)
            g_want = torch.autograd.grad(weighted(want, seed), args)
            for a, b in zip(g_got, g_want): torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name} grad: {m}")
            assert got.abs().gt(0.1).sum() >= 3                                   # not a test of zeros

@pytest.mark.parametrize('lat', LATTICES, ids=repr)
def test_cuda_variants_give_the_same_bits(lat, monkeypatch):
    """The CUDA entropy and KL ($SEQDIST_TDT_DIVERGENCE: split, the default, and fused; emulated): the same values and
    gradients bit for bit (split's edge gradients are the fused backward's, taken by a kernel of their own). A variant
    it does not know is refused."""
    x, xq, y, il, tl = batch(lat, 21)
    got = {}
    for variant in ('split', 'fused'):
        monkeypatch.setenv('SEQDIST_TDT_DIVERGENCE', variant)
        a, b = x.detach().requires_grad_(), xq.detach().requires_grad_()
        h, kl = lat.entropy(a, y, il, tl, backend='cuda'), lat.kl(a, b, y, il, tl, backend='cuda')
        got[variant] = [h.detach(), kl.detach(), *torch.autograd.grad(weighted(h, 1) + weighted(kl, 2), (a, b))]
    for u, v in zip(got['split'], got['fused']): assert torch.equal(u, v)
    monkeypatch.setenv('SEQDIST_TDT_DIVERGENCE', 'both')
    with pytest.raises(ValueError, match="SEQDIST_TDT_DIVERGENCE must be 'split' or 'fused'"):
        lat.entropy(x.detach().requires_grad_(), y, il, tl, backend='cuda')

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
@pytest.mark.parametrize('lat', LATTICES, ids=repr)
def test_gradcheck_of_the_cpu_kernels(lat, backend):
    "The CPU and CUDA paths' closed-form gradients against finite differences on a tiny case (two sequences, one label)."
    g = torch.Generator().manual_seed(14)
    W = 3 + len(lat.spec) if lat.tdt else 2 + len(lat.spec)
    x = torch.randn(2, 3, 2, W, generator=g, dtype=torch.float64).requires_grad_()
    y, il, tl = torch.full((2, 1), 1 if lat.tdt else 0), torch.tensor([3, 2]), torch.tensor([1, 0])
    xq = torch.randn(2, 3, 2, W, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: lat.entropy(x, y, il, tl, backend=backend), (x,))
    assert torch.autograd.gradcheck(lambda x, q: lat.kl(x, q, y, il, tl, backend=backend), (x, xq))
    assert torch.autograd.gradcheck(lambda x, q: lat.ce(x, q, y, il, tl, backend=backend), (x, xq), fast_mode=True)

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_no_path_gives_zero_and_a_zero_gradient(backend):
    x, xq, y, il, tl = batch(TDT_NO_ZERO, 5)
    x = x.detach().requires_grad_()
    (TDT_NO_ZERO.entropy(x, y, il, tl, backend=backend).sum() + TDT_NO_ZERO.kl(x, xq, y, il, tl, backend=backend).sum()).backward()
    assert torch.isfinite(x.grad).all() and x.grad[-1].eq(0).all() and x.grad[0].ne(0).any()

# -- k-best ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('k', [1, 4, 16])
@pytest.mark.parametrize('lat', LATTICES, ids=repr)
def test_kbest_equals_the_sorted_enumeration(lat, k):
    x, _, y, il, tl = batch(lat, 6, scale=2.0)
    B, T, U1, _ = x.shape
    x = x.detach().requires_grad_()
    frames, durations, blanks, scores = lat.kbest(x, y, il, tl, k=k)
    assert frames.shape == durations.shape == (k, B, U1 - 1) and blanks.shape == (k, B, T) and scores.shape == (k, B)
    grad = torch.zeros_like(x)
    for b in range(B):
        T_b, U_b = int(il[b]), int(tl[b])
        paths = lat.paths(T_b, U_b)
        s = lat.scores(x[b], y[b], paths)
        order = s.detach().argsort(descending=True)[:k].tolist()
        m = len(order)
        torch.testing.assert_close(scores[:m, b].detach(), s[order].detach(), rtol=1e-12, atol=1e-12)
        for j, i in enumerate(order):
            want = lat.timestamps(paths[i], T_b, U_b)
            assert (tuple(frames[j, b, :U_b].tolist()), tuple(durations[j, b, :U_b].tolist()),
                    tuple(blanks[j, b, :T_b].tolist())) == want, (b, j)
        assert frames[:m, b, U_b:].eq(-1).all() and durations[:m, b, U_b:].eq(-1).all() and blanks[:m, b, T_b:].eq(-1).all()
        assert frames[m:, b].eq(-1).all() and blanks[m:, b].eq(-1).all() and scores[m:, b].eq(-math.inf).all()
        if m: grad[b] = torch.autograd.grad(s[order[0]], x)[0][b]
    assert (lat is not TDT_NO_ZERO) or scores[:, -1].eq(-math.inf).all()
    # the scores are differentiable: the best score's gradient is that of its path's enumerated score
    scores[0].masked_fill(torch.isinf(scores[0]), 0).sum().backward()
    torch.testing.assert_close(x.grad, grad, rtol=1e-12, atol=1e-12)

@pytest.mark.parametrize('k', [1, 4, 16])
@pytest.mark.parametrize('lat', LATTICES, ids=repr)
@pytest.mark.parametrize('kernel', ['cpu', 'cuda'])
def test_kernel_kbest_equals_the_reference(kernel, lat, k):
    """The CPU kernel's k best paths (back-pointers), and the CUDA kernel's (K-way merges; through the emulator here),
    are the reference's (gradient marks), scores and their gradients too."""
    x, _, y, il, tl = batch(lat, 40 + k, scale=2.0)                         # random fp64: no ties
    for differentiable in (False, True):
        x = x.detach().requires_grad_(differentiable)
        got, want = (lat.kbest(x, y, il, tl, k=k, backend=backend) for backend in (kernel, 'reference'))
        for a, b in zip(got[:3], want[:3]): assert torch.equal(a, b)
        torch.testing.assert_close(got[3], want[3], rtol=1e-12, atol=1e-12)
        assert got[3].requires_grad == differentiable
    g_got, g_want = (torch.autograd.grad(weighted(s.masked_fill(torch.isinf(s), 0), k), x)[0] for s in (got[3], want[3]))
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)

def test_kbest_pads_when_there_are_fewer_paths():
    x = torch.randn(1, 2, 2, 6 + 3, dtype=torch.float64)
    frames, durations, blanks, scores = kbest_alignments(x, torch.tensor([[1]]), torch.tensor([2]), torch.tensor([1]),
                                                         durations=(0, 1, 2), k=16)
    m = len(tdt_paths(2, 1, (0, 1, 2)))
    assert torch.isfinite(scores[:m]).all() and scores[m:].eq(-math.inf).all() and frames[m:].eq(-1).all()
    assert not scores.requires_grad and (scores[:-1] >= scores[1:]).all()
    assert len({str(p) for p in zip(frames[:m, 0].tolist(), durations[:m, 0].tolist(), blanks[:m, 0].tolist())}) == m

# -- samples -----------------------------------------------------------------------------------------------------------

def occupancy(lat, frames, durations, blanks, x, y, il, tl):
    """The posterior of each edge kind leaving each node, summed over u for the blanks (the frame and duration of a
    label; of a blank), from the forward-backward (`tdt_alignments`), and the samples' frequency of each: (B, T, U, D)
    and (B, T, D') both."""
    B, T, U1, _ = x.shape
    if lat.tdt:
        post = tdt_alignments(x, y, il, tl, lat.spec, lat.blank, lat.sigma, backend='reference')    # (B, T, U+1, 2, D)
        label_p, blank_p, ds = post[:, :, :-1, 1].transpose(1, 2), post[..., 0, :].sum(2), list(lat.spec)
        label_d = ds
    else:
        post = multiblank_alignments(x, y, il, tl, lat.spec, lat.blank, lat.sigma, backend='reference')  # (B, T, U+1, 2 + n)
        label_p, blank_p, ds = post[:, :, :-1, -1:].transpose(1, 2), post[..., :-1].sum(2), [1] + list(lat.spec)
        label_d = [0]
    n = frames.shape[0]
    t = torch.arange(T)
    label_f = torch.stack([((frames[..., None] == t) & (durations == d)[..., None]).double().mean(0) for d in label_d], -1)
    blank_f = torch.stack([(blanks == d).double().mean(0) if d else torch.zeros(B, T) for d in ds], -1)   # (no blank d=0)
    return (label_p, label_f), (blank_p, blank_f), n

@pytest.mark.parametrize('lat', LATTICES, ids=repr)
def test_samples_match_the_exact_path_probabilities(lat):
    x, _, y, il, tl = batch(lat, 7, scale=0.5)                  # a flat posterior: many paths with counts to test
    B, T, U1, _ = x.shape
    n = 20000
    frames, durations, blanks, logp = lat.sample(x, y, il, tl, n=n, generator=torch.Generator().manual_seed(0))
    assert frames.shape == durations.shape == (n, B, U1 - 1) and blanks.shape == (n, B, T) and logp.shape == (n, B)
    tested = []
    for b in range(B):
        T_b, U_b = int(il[b]), int(tl[b])
        paths = lat.paths(T_b, U_b)
        if not paths:
            assert frames[:, b].eq(-1).all() and blanks[:, b].eq(-1).all() and logp[:, b].eq(-math.inf).all(); continue
        assert frames[:, b, U_b:].eq(-1).all() and blanks[:, b, T_b:].eq(-1).all()
        logprob = lat.scores(x[b], y[b], paths).log_softmax(0)
        index = {lat.timestamps(p, T_b, U_b): i for i, p in enumerate(paths)}
        assert len(index) == len(paths)                                      # the format tells paths apart
        keys = zip(map(tuple, frames[:, b, :U_b].tolist()), map(tuple, durations[:, b, :U_b].tolist()),
                   map(tuple, blanks[:, b, :T_b].tolist()))
        drawn = torch.tensor([index[key] for key in keys])                  # KeyError: not a path
        torch.testing.assert_close(logp[:, b], logprob[drawn], rtol=1e-10, atol=1e-12)
        if len(paths) == 1: continue
        df = check_counts(drawn, logprob, n, b)
        tested.append(df)
    assert sum(df >= 5 for df in tested) >= 2, tested                      # (not only one- and two-path sequences)
    # per-edge occupancy within 5 sigma of the posteriors of the forward-backward
    for p, f in occupancy(lat, frames, durations, blanks, x, y, il, tl)[:2]:
        assert ((f - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-12).all()
        assert (p > 0.05).sum() > 10                                          # not a test of zeros

@pytest.mark.parametrize('kernel', ['cpu', 'cuda'])
@pytest.mark.parametrize('lat', LATTICES, ids=repr)
def test_cpu_sampler_draws_the_reference_samples(lat, kernel):
    """The same generator gives the CPU kernel, the CUDA kernels (emulated) and the reference the same samples; their
    log-probabilities and gradients agree."""
    for seed in range(2):
        x, _, y, il, tl = batch(lat, 30 + seed)
        for differentiable in (False, True):
            x = x.detach().requires_grad_(differentiable)
            got, want = (lat.sample(x, y, il, tl, n=100, generator=torch.Generator().manual_seed(seed), backend=backend)
                         for backend in (kernel, 'reference'))
            for a, b in zip(got[:3], want[:3]): assert torch.equal(a, b)
            torch.testing.assert_close(got[3], want[3], rtol=1e-12, atol=1e-12)
            assert got[3].requires_grad == differentiable and torch.isfinite(got[3]).sum() >= 300
        g_got, g_want = (torch.autograd.grad(weighted(l.masked_fill(torch.isinf(l), 0), seed), x)[0] for l in (got[3], want[3]))
        torch.testing.assert_close(g_got, g_want, rtol=1e-9, atol=1e-12)

@pytest.mark.parametrize('lat', [TDT, MULTIBLANK], ids=repr)
def test_samples_are_reproducible_from_the_generator(lat):
    x, _, y, il, tl = batch(lat, 8)
    a = lat.sample(x, y, il, tl, n=50, generator=torch.Generator().manual_seed(7))
    b = lat.sample(x, y, il, tl, n=50, generator=torch.Generator().manual_seed(7))
    c = lat.sample(x, y, il, tl, n=50, generator=torch.Generator().manual_seed(8))
    assert all(torch.equal(u, v) for u, v in zip(a, b)) and not torch.equal(a[2], c[2])
    torch.manual_seed(1); d = lat.sample(x, y, il, tl, n=50)
    torch.manual_seed(1); e = lat.sample(x, y, il, tl, n=50)
    assert all(torch.equal(u, v) for u, v in zip(d, e))

@pytest.mark.parametrize('lat', [TDT, MULTIBLANK], ids=repr)
def test_sample_log_probabilities_are_differentiable(lat):
    x, _, y, il, tl = batch(lat, 9)
    x = x[:3].detach().requires_grad_()
    y, il, tl = y[:3], il[:3], tl[:3]
    frames, durations, blanks, logp = lat.sample(x, y, il, tl, n=3, generator=torch.Generator().manual_seed(0))
    logp.sum().backward()
    want = torch.zeros_like(x)
    for b in range(3):
        T_b, U_b = int(il[b]), int(tl[b])
        paths = lat.paths(T_b, U_b)
        index = {lat.timestamps(p, T_b, U_b): i for i, p in enumerate(paths)}
        lp = lat.scores(x[b], y[b], paths).log_softmax(0)
        for j in range(3):
            key = (tuple(frames[j, b, :U_b].tolist()), tuple(durations[j, b, :U_b].tolist()), tuple(blanks[j, b, :T_b].tolist()))
            want += torch.autograd.grad(lp[index[key]], x, retain_graph=True)[0]
    torch.testing.assert_close(x.grad, want, rtol=1e-10, atol=1e-12)

# -- a peaky model: tiny entropy ---------------------------------------------------------------------------------------

def entropy_high_precision(lat, x, y, T_b, U_b, digits=60):
    """The entropy of a sequence's paths in decimal arithmetic with `digits` digits, from the fp64 log-probabilities of its
    edges (exact in decimal)."""
    Dec = decimal.Decimal
    paths = lat.paths(T_b, U_b)
    V = lat.V(x)
    tok, dur = (x[..., :V].log_softmax(-1) - lat.sigma).tolist(), x[..., V:].log_softmax(-1).tolist()
    blank = lat.blank % V
    with decimal.localcontext() as ctx:
        ctx.prec = digits
        def edge(t, u, label, i):
            if lat.tdt: return Dec(tok[t][u][y[u] if label else blank]) + Dec(dur[t][u][i])
            return Dec(tok[t][u][y[u] if label else (blank if i == 0 else blank - i)])
        scores = [sum((edge(*e) for e in p), Dec(0)) for p in paths]
        m = max(scores)
        logz = m + sum(((s - m).exp() for s in scores), Dec(0)).ln()
        return float(-sum((s - logz).exp() * (s - logz) for s in scores))

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
@pytest.mark.parametrize('lat', [TDT, MULTIBLANK], ids=repr)
def test_entropy_of_a_peaky_model_is_accurate(lat, backend):
    x, _, y, il, tl = batch(lat, 10)
    T_b, U_b = 5, 3
    x, y, il, tl = x[:1], y[:1], il[:1], tl[:1]
    V = lat.V(x)
    best = lat.paths(T_b, U_b)[len(lat.paths(T_b, U_b)) // 2]             # one path is made much the likeliest
    for t, u, label, i in best:
        x[0, t, u, y[0, u] if label else (lat.blank % V if lat.tdt or i == 0 else lat.blank % V - i)] += 34.0
        if lat.tdt: x[0, t, u, V + i] += 34.0
    h = lat.entropy(x, y, il, tl, backend=backend)[0].item()
    want = entropy_high_precision(lat, x[0], y[0].tolist(), T_b, U_b)
    assert 1e-13 < want < 1e-11 and abs(h - want) <= 1e-10 * want, (h, want)
    # log Z - E[score], the same sum in fp64 without the semiring, loses digits: it misses even a 1e-6 bound
    s = lat.scores(x[0], y[0], lat.paths(T_b, U_b))
    naive = (s.logsumexp(0) - (s.softmax(0) * s).sum()).item()
    assert abs(naive - want) > 1e-6 * want, (naive, want)

# -- edge cases and bad inputs -----------------------------------------------------------------------------------------

def test_float32_and_low_precision():
    x, xq, y, il, tl = batch(TDT, 11)
    h = TDT.entropy(x, y, il, tl)
    h32 = TDT.entropy(x.float(), y, il, tl)
    assert h32.dtype == torch.float32
    torch.testing.assert_close(h32.double(), h, rtol=1e-5, atol=1e-6)
    assert TDT.entropy(x.bfloat16(), y, il, tl).dtype == torch.float32          # computed in float32

def test_inputs_are_left_unmodified_and_one_label_per_frame_is_not_required():
    x, xq, y, il, tl = batch(MULTIBLANK, 12)
    x0, y0 = x.clone(), y.clone()
    MULTIBLANK.kbest(x, y, il, tl, k=2); MULTIBLANK.sample(x, y, il, tl, n=2)
    assert torch.equal(x, x0) and torch.equal(y, y0)
    frames = MULTIBLANK.kbest(x, y, il, tl, k=16)[0]
    assert (frames[..., 1:] == frames[..., :-1]).any()                         # labels share a frame (duration 0)

def expect(error, match, f, *args, **kw):
    with pytest.raises(error, match=match): f(*args, **kw)

def test_bad_inputs_are_clear_errors():
    x, xq, y, il, tl = batch(TDT, 13)
    xm, _, ym, _, _ = batch(MULTIBLANK, 13)
    for lat, x_, y_ in ((TDT, x, y), (MULTIBLANK, xm, ym)):
        V = lat.V(x_)
        for f in (lat.entropy, lat.kbest, lat.sample):
            expect(ValueError, r'logit_lengths must be in \[1, T\]', f, x_, y_, torch.tensor([6, 5, 4, 3, 2]), tl)
            expect(ValueError, r'target_lengths must be in', f, x_, y_, il, torch.tensor([4, 0, 2, 1, 2]))
            expect(TypeError, r'targets must hold integers', f, x_, y_.float(), il, tl)
            expect(ValueError, r'logits must have shape', f, x_[0], y_, il, tl)
            expect(ValueError, r'backend must be', f, x_, y_, il, tl, backend='numba')
            bad = y_.clone(); bad[0, 0] = lat.blank % V
            expect(ValueError, r'blank', f, x_, bad, il, tl)
        for f in (lat.kl, lat.ce):
            expect(ValueError, r'same shape', f, x_, x_[:4], y_, il, tl)
        expect(ValueError, r'reduction must be', lat.entropy, x_, y_, il, tl, reduction='mean_batch')
        for k in (0, 17, 2.0, True): expect(ValueError, r'k must be an int in \[1, 16\]', lat.kbest, x_, y_, il, tl, k=k)
        for n in (0, -1, 1.5): expect(ValueError, r'n must be a positive int', lat.sample, x_, y_, il, tl, n=n)
        expect(TypeError, r'generator must be', lat.sample, x_, y_, il, tl, generator=3)
    expect(ValueError, r'durations must include 1', alignment_entropy, x, y, il, tl, (0, 2, 3))
    expect(ValueError, r'sigma must be finite', alignment_entropy, x, y, il, tl, sigma=math.inf)
    bad = ym.clone(); bad[0, 0] = MULTIBLANK.blank % 6 - 1                    # a big blank as a label
    expect(ValueError, r'targets contain big blanks', multiblank_alignment_entropy, xm, bad, il, tl, (2, 3))
    expect(ValueError, r'big_blank_durations must be >= 2', multiblank_kbest_alignments, xm, ym, il, tl, (1, 3))

# -- the distribution objects ------------------------------------------------------------------------------------------

@pytest.mark.parametrize('lat', LATTICES, ids=repr)
def test_alignments_object_against_enumeration_and_the_functions(lat):
    """TDTAlignments / MultiblankAlignments: log_prob of every enumerated path is its posterior log-probability (so they
    sum to 1) and gives the entropy and KL; timestamps that are not an alignment get -inf; samples' log_prob is
    sample_alignments' log-probability; argmax, topk, sample and marginals are the functions'."""
    from seqdist.tdt import TDTAlignments, MultiblankAlignments
    x, xq, y, il, tl = batch(lat, 11)
    B, T, U = x.shape[0], x.shape[1], x.shape[2] - 1
    cls = TDTAlignments if lat.tdt else MultiblankAlignments
    d, dq = (cls(z, y, il, tl, lat.spec, blank=lat.blank, sigma=lat.sigma) for z in (x, xq))
    ent, kl, logz = d.entropy(), d.kl(dq), d.log_partition
    for b in range(B):
        T_b, U_b = int(il[b]), int(tl[b])
        paths = lat.paths(T_b, U_b)
        if not paths:
            assert torch.isinf(logz[b]) and ent[b] == 0; continue
        value = [torch.full((len(paths), B, n), -1) for n in (U, U, T)]
        for i, key in enumerate(lat.timestamps(p, T_b, U_b) for p in paths):
            for v, k, n in zip(value, key, (U_b, U_b, T_b)): v[i, b, :n] = torch.tensor(k, dtype=torch.long)
        lp, lq = d.log_prob(tuple(value))[:, b], dq.log_prob(tuple(value))[:, b]
        close(lp, lat.scores(x[b], y[b], paths).log_softmax(0))
        close(lp.exp().sum(), torch.tensor(1.0, dtype=torch.float64))
        close(ent[b], -(lp.exp() * lp).sum()); close(kl[b], (lp.exp() * (lp - lq)).sum())
        frames, durs, blanks = (v[:1].clone() for v in value)          # not alignments: each gets -inf
        bad = []
        for which, where, to in ((0, (0, b, 0), T_b), (2, (0, b, 0), 0), (0, (0, b, U - 1), 0) if U_b < U else (2, (0, b, T_b - 1), 7)):
            v = [frames.clone(), durs.clone(), blanks.clone()]
            v[which][where] = to
            bad.append(d.log_prob(tuple(v))[0, b])
        assert torch.isinf(torch.stack(bad)).all(), bad
    *drawn, logp = lat.sample(x, y, il, tl, n=6, generator=torch.Generator().manual_seed(3))
    close(d.log_prob(tuple(drawn)), logp)
    again = d.sample((2, 3), generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(a, v.reshape(2, 3, *v.shape[1:])) for a, v in zip(again, drawn))
    *top, scores = lat.kbest(x, y, il, tl, k=4)
    assert all(torch.equal(a, v[0]) for a, v in zip(d.argmax, top))
    assert all(torch.equal(a, v) for a, v in zip(d.topk(4), (*top, scores)))
    have = ~torch.isinf(logz)
    close(d.log_prob(tuple(top))[:, have], (scores - logz)[:, have])
    labels = d.marginals[..., 1, :] if lat.tdt else d.marginals[..., -1]
    close(labels.sum((1, 2, 3)) if lat.tdt else labels.sum((1, 2)), torch.where(have, tl, 0).double())
    with pytest.raises(ValueError, match='value must be a tuple'):
        d.log_prob(top[0])
