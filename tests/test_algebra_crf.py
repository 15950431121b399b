"""Every question on the CTC-CRF against enumeration of all its paths (and of all alignments of small targets):
entropy, KL and cross-entropy (values and gradcheck), k-best paths, exact samples (a chi-square test and per-frame
occupancy), a peaky case, infeasible targets, bad inputs; and the semiring-generic sparse reference they run on."""
import functools, itertools, math
import pytest, torch
from seqdist import sparse, ctc_simple
from seqdist.core import Log, Max, Entropy, KL, CrossEntropy, KMax, log_softmax_parts
from seqdist.crf import CTC_CRF, _sample_edges, crf_divergence_op
from seqdist.ops import launch_limits
from sampling_checks import chi_square, chi_square_bound

def close(a, b, rtol=1e-10, atol=1e-12): torch.testing.assert_close(a, b, rtol=rtol, atol=atol)

# -- enumeration --------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def all_paths(state_len, n_base, T):
    """Every path of a k-mer CTC-CRF over T frames, from the score layout's definition (not from `kmer_transitions`): a
    start k-mer, then at each frame a stay (column 0 of the k-mer's group of n_base + 1 scores) or a move that drops the
    k-mer's first base b and appends a new one (column 1 + b of the entered k-mer's group). Returns the score column of
    each frame (P, T) and the k-mer after each frame (P, T + 1), k-mers numbered as base-n_base numbers, first base first."""
    NZ = n_base + 1
    kmers = list(itertools.product(range(n_base), repeat=state_len))
    number = {k: i for i, k in enumerate(kmers)}
    paths = [([k], []) for k in kmers]
    for _ in range(T):
        paths = [(states + [k2], cols + [col]) for states, cols in paths
                 for k2, col in [(states[-1], number[states[-1]] * NZ)] +
                                [(states[-1][1:] + (b,), number[states[-1][1:] + (b,)] * NZ + 1 + states[-1][0]) for b in range(n_base)]]
    cols = torch.tensor([c for _, c in paths], dtype=torch.long).view(len(paths), T)
    states = torch.tensor([[number[k] for k in s] for s, _ in paths], dtype=torch.long)
    return cols, states

def path_scores(scores, b, cols):
    "The scores (P,) of paths given as score columns (P, T), for sequence b."
    T = scores.shape[0]
    return scores[torch.arange(T), b, cols].sum(-1)

def alignments_of(crf, T, target):
    """The CRF's paths that align `target` (a list of bases 1..n_base): those that start in its first k-mer and whose
    moves enter its other k-mers in order. Returns their score columns (P, T) and, at each frame, the index of the
    target's k-mer the path leaves (P, T): ctc_viterbi_alignments' format before its one-hot."""
    cols, states = all_paths(crf.state_len, crf.n_base, T)
    k = crf.state_len
    kmers = [sum((target[i + j] - 1) * crf.n_base ** (k - 1 - j) for j in range(k)) for i in range(len(target) - k + 1)]
    move = cols % (crf.n_base + 1) != 0
    keep = []
    for p in range(len(cols)):
        entered = states[p, 1:][move[p]].tolist()
        if states[p, 0] == kmers[0] and entered == kmers[1:]: keep.append(p)
    keep = torch.tensor(keep, dtype=torch.long)
    left = torch.cat([torch.zeros(len(keep), 1, dtype=torch.long), move[keep].long().cumsum(1)[:, :-1]], 1)
    return cols[keep], left

def entropy_kl_ce(sp, sq):
    "Entropy of p, KL(p || q) and cross-entropy of p and q from the path scores of both, by enumeration."
    lp, lq = sp.log_softmax(0), sq.log_softmax(0)
    p = lp.exp()
    return -(p * lp).sum(), (p * (lp - lq)).sum(), -(p * lq).sum()

def random_scores(crf, T, N, seed, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(T, N, crf.n_score(), generator=g, dtype=dtype)

READS = {1: ([[1, 2, 2, 0], [3, 1, 4, 2]], [3, 4]), 2: ([[1, 2, 3, 0], [2, 2, 2, 2]], [3, 4])}   # state_len: targets, lengths

# -- the semiring-generic sparse reference -------------------------------------------------------------------------------

def test_sparse_reference_answers_every_semiring():
    crf = CTC_CRF(2, 'NACGT')
    Ms = torch.randn(4, 3, crf.n_states, 5, dtype=torch.float64)
    idx, v = crf.idx.long(), torch.zeros(3, crf.n_states, dtype=torch.float64)
    for S in (Log, Max):                                # as seqdist 0.0.3's scan gives them
        close(sparse.logZ_reference(Ms, idx, v, v, S), S.sum(S.mul(sparse.Mv_scan_py(Ms, idx, v, S)[-1], v), dim=1), rtol=0, atol=0)
    logz = sparse.logZ_reference(Ms, idx, v, v, Log)
    close(sparse.logZ_reference(Ms, idx, v, v, Entropy)[0], logz)
    close(sparse.logZ_reference(torch.stack([Ms, Ms]), idx, torch.stack([v, v]), torch.stack([v, v]), KL)[2], torch.zeros(3, dtype=torch.float64))
    close(sparse.logZ_reference(Ms, idx, v, v, KMax(1))[0], sparse.logZ_reference(Ms, idx, v, v, Max))
    assert sparse.forward_scores_reference(Ms, idx, v, KMax(3)).shape == (5, 3, 3, crf.n_states)

# -- entropy, KL, cross-entropy ------------------------------------------------------------------------------------------

BACKENDS = pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])   # ('cuda': the CUDA kernels, emulated)
DIVERGENCE_BACKENDS = pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])   # entropy, KL, samples; 'cuda': emulated

@DIVERGENCE_BACKENDS
@pytest.mark.parametrize('state_len, T', [(1, 4), (2, 3)])
def test_entropy_kl_cross_entropy_of_the_paths_equal_enumeration(state_len, T, backend):
    crf = CTC_CRF(state_len, 'NACGT')
    sp, sq = random_scores(crf, T, 2, 0), random_scores(crf, T, 2, 1)
    cols, _ = all_paths(state_len, 4, T)
    assert len(cols) == 4 ** state_len * 5 ** T
    want = torch.stack([torch.stack(entropy_kl_ce(path_scores(sp, b, cols), path_scores(sq, b, cols))) for b in range(2)], 1)
    close(torch.stack([crf.entropy(sp, backend=backend), crf.kl(sp, sq, backend=backend),
                       crf.cross_entropy(sp, sq, backend=backend)]), want)
    close(torch.logsumexp(torch.stack([path_scores(sp, b, cols) for b in range(2)], 1), 0), crf.logZ(sp))   # the same paths

@DIVERGENCE_BACKENDS
@pytest.mark.parametrize('state_len', [1, 2])
def test_entropy_kl_cross_entropy_of_the_alignments_equal_enumeration(state_len, backend):
    crf, T = CTC_CRF(state_len, 'NACGT'), 5 if state_len == 1 else 4
    sp, sq = random_scores(crf, T, 2, 2), random_scores(crf, T, 2, 3)
    targets, lengths = READS[state_len]
    tg, tl = torch.tensor(targets), torch.tensor(lengths)
    want, log_p = [], []
    for b in range(2):
        cols, _ = alignments_of(crf, T, targets[b][:lengths[b]])
        a, q = path_scores(sp, b, cols), path_scores(sq, b, cols)
        want.append(torch.stack(entropy_kl_ce(a, q)))
        log_p.append(a.logsumexp(0) - crf.logZ(sp)[b])
    close(torch.stack([crf.entropy(sp, tg, tl, backend=backend), crf.kl(sp, sq, tg, tl, backend=backend),
                       crf.cross_entropy(sp, sq, tg, tl, backend=backend)]), torch.stack(want, 1))
    close(-crf.ctc_loss(sp, tg, tl, reduction='none') * tl, torch.stack(log_p))      # the lattice ctc_loss sums over

@DIVERGENCE_BACKENDS
def test_gradcheck(backend):
    crf = CTC_CRF(1, 'NACG')
    sp = random_scores(crf, 3, 2, 4).requires_grad_()
    sq = random_scores(crf, 3, 2, 5).requires_grad_()
    tg, tl = torch.tensor([[1, 2, 0], [2, 2, 3]]), torch.tensor([2, 3])
    check = lambda f, *xs: torch.autograd.gradcheck(f, xs, fast_mode=True)
    for t in ({'backend': backend}, {'targets': tg, 'target_lengths': tl, 'backend': backend}):
        assert check(lambda x: crf.entropy(x, **t), sp)
        assert check(lambda x, y: crf.kl(x, y, **t), sp, sq)
        assert check(lambda x, y: crf.cross_entropy(x, y, **t), sp, sq)
        assert check(lambda x: crf.sample(x, n=4, generator=torch.Generator().manual_seed(0), **t)[1], sp)
        assert check(lambda x: crf.kbest(x, k=3, **t)[1], sp)

@DIVERGENCE_BACKENDS
def test_entropy_of_a_peaky_model_is_accurate(backend):
    crf, T = CTC_CRF(1, 'NACGT'), 4
    cols, _ = all_paths(1, 4, T)
    scores = random_scores(crf, T, 1, 6, scale=0.1)
    scores[torch.arange(T), 0, cols[1234]] += 33.0         # one path much the likeliest: its edges far above the rest
    s = path_scores(scores, 0, cols)
    _, lp = log_softmax_parts(s)                           # the dominant path's log-probability to full precision
    want = -(lp.exp() * lp).sum()                          # a sum of non-negative terms: exact to rounding
    h = crf.entropy(scores, backend=backend)[0]
    assert 1e-14 < want < 1e-10 and abs(h - want) <= 1e-6 * want, (h.item(), want.item())
    naive = s.logsumexp(0) - (s.softmax(0) * s).sum()      # log Z - E[score] from the same float64 scores
    assert abs(naive - want) > 1e-3 * want                 # (2.8% off here: 28,000 times our error bound)
    # the same for a read's alignments: one alignment much the likeliest
    tg, tl = torch.tensor([[1, 2, 3]]), torch.tensor([3])
    acols, _ = alignments_of(crf, T, [1, 2, 3])
    scores = random_scores(crf, T, 1, 7, scale=0.1)
    scores[torch.arange(T), 0, acols[0]] += 16.0
    _, lp = log_softmax_parts(path_scores(scores, 0, acols))
    want = -(lp.exp() * lp).sum()
    h = crf.entropy(scores, tg, tl, backend=backend)[0]
    assert 1e-16 < want < 1e-10 and abs(h - want) <= 1e-6 * want, (h.item(), want.item())

def divergences_and_gradients(crf, sp, sq, backend, **t):
    "Entropy, KL and cross-entropy (3, N) on `backend` and their gradients w.r.t. sp and sq (each of a random weighting)."
    out = []
    w = torch.randn(3, sp.shape[1], generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    for i, f in enumerate((lambda: crf.entropy(sp, **t, backend=backend), lambda: crf.kl(sp, sq, **t, backend=backend),
                           lambda: crf.cross_entropy(sp, sq, **t, backend=backend))):
        v = f()
        gp, gq = torch.autograd.grad((v.double() * w[i]).sum(), (sp, sq), allow_unused=True)
        out.append((v, gp, torch.zeros_like(sp) if gq is None else gq))
    return out

def test_cpu_kernel_agrees_with_the_reference_beyond_enumeration():
    "state_len 3 (64 states, 5 in-edges each), T 50, N 3: values and gradients to 1e-10 in float64, paths and alignments."
    crf, T, N = CTC_CRF(3, 'NACGT'), 50, 3
    sp, sq = random_scores(crf, T, N, 20).requires_grad_(), random_scores(crf, T, N, 21, scale=1.5).requires_grad_()
    g = torch.Generator().manual_seed(22)
    tg = torch.randint(1, 5, (N, 20), generator=g)
    tl = torch.tensor([20, 13, 3])                     # the last: one k-mer, only stays
    for t in ({}, {'targets': tg, 'target_lengths': tl}):
        for (a, ga, qa), (b, gb, qb) in zip(divergences_and_gradients(crf, sp, sq, 'cpu', **t),
                                            divergences_and_gradients(crf, sp, sq, 'reference', **t)):
            close(a, b); close(ga, gb); close(qa, qb)
            assert a[:2].ne(0).all()                   # (the one-k-mer read has one alignment: 0)

def test_cpu_kernel_float32_and_under_torch_compile():
    crf, T, N = CTC_CRF(2, 'NACGT'), 12, 2
    sp = random_scores(crf, T, N, 23)
    sq = random_scores(crf, T, N, 24)
    tg, tl = torch.tensor([[1, 2, 3, 4], [4, 4, 1, 0]]), torch.tensor([4, 3])
    for t in ({}, {'targets': tg, 'target_lengths': tl}):
        x, y = sp.float().requires_grad_(), sq.float().requires_grad_()
        want = divergences_and_gradients(crf, sp.clone().requires_grad_(), sq.clone().requires_grad_(), 'reference', **t)
        for (a, ga, qa), (b, gb, qb) in zip(divergences_and_gradients(crf, x, y, 'cpu', **t), want):
            assert a.dtype == ga.dtype == torch.float32
            close(a.double(), b, rtol=1e-5, atol=1e-5); close(ga.double(), gb, rtol=1e-5, atol=1e-5)
            close(qa.double(), qb, rtol=1e-5, atol=1e-5)
        x = sp.clone().requires_grad_()
        f = torch.compile(lambda s: crf.entropy(s, **t, backend='cpu'), backend='eager', fullgraph=False)
        h = f(x)
        g, = torch.autograd.grad(h.sum(), x)
        x2 = sp.clone().requires_grad_()
        h2 = crf.entropy(x2, **t, backend='cpu')
        close(h, h2, rtol=0, atol=0); close(g, torch.autograd.grad(h2.sum(), x2)[0], rtol=0, atol=0)
    # the op itself under compile: its registered fake and backward
    Ms = crf._Ms(sp).clone().requires_grad_()
    v = torch.zeros(N, crf.n_states, dtype=torch.float64)
    op = torch.compile(lambda m: crf_divergence_op(m, None, crf.idx, v, v, 'Entropy', True, backend='cpu')[0],
                       backend='eager', fullgraph=True)
    close(op(Ms), crf.entropy(sp, backend='reference'))
    x = sp.clone().requires_grad_()
    close(torch.autograd.grad(op(Ms).sum(), Ms)[0].flatten(2),
          torch.autograd.grad(crf.entropy(x, backend='reference').sum(), x)[0])

# -- k best paths --------------------------------------------------------------------------------------------------------

@BACKENDS
@pytest.mark.parametrize('k', [1, 4, 16])
def test_kbest_equals_the_sorted_enumeration(k, backend):
    crf, T = CTC_CRF(1, 'NACGT'), 3
    scores = random_scores(crf, T, 2, 8)
    cols, _ = all_paths(1, 4, T)
    paths, best = crf.kbest(scores, k=k, backend=backend)
    assert paths.shape == (k, T, 2) and best.shape == (k, 2)
    for b in range(2):
        s = path_scores(scores, b, cols)
        top = s.topk(k)
        close(best[:, b], top.values)
        assert torch.equal(paths[:, :, b], cols[top.indices])
    close(path_scores(scores, 0, paths[:, :, 0]), best[:, 0])
    assert torch.equal(crf.edge_labels(crf.kbest(scores, k=1, backend=backend)[0][0]), crf.viterbi(scores))
    # given targets
    targets, lengths = READS[1]
    T = 5
    scores = random_scores(crf, T, 2, 9)
    paths, best = crf.kbest(scores, k=k, targets=torch.tensor(targets), target_lengths=torch.tensor(lengths), backend=backend)
    for b in range(2):
        acols, left = alignments_of(crf, T, targets[b][:lengths[b]])
        s = path_scores(scores, b, acols)
        top = s.topk(min(k, len(s)))
        close(best[:len(top.values), b], top.values)
        n_kmers = len(targets[b])
        want = torch.nn.functional.one_hot(left[top.indices], n_kmers).double()      # (k, T, kmers)
        assert torch.equal(paths[:len(top.values), :, b], want)
    viterbi = crf.ctc_viterbi_alignments(scores, torch.tensor(targets), torch.tensor(lengths))
    assert torch.equal(paths[0], viterbi)

@BACKENDS
def test_kbest_pads_where_there_are_fewer_paths(backend):
    crf = CTC_CRF(1, 'NA')                                 # one state, entered by a stay and by a move: 2^T paths
    scores = random_scores(crf, 2, 1, 10)
    paths, best = crf.kbest(scores, k=6, backend=backend)
    assert torch.isfinite(best[:4]).all() and best[4:].eq(-math.inf).all() and paths[4:].eq(-1).all() and paths[:4].ge(0).all()
    crf = CTC_CRF(1, 'NACGT')
    scores = random_scores(crf, 3, 2, 11)
    tg = torch.tensor([[1, 2, 3, 4, 1], [1, 2, 3, 4, 0]])   # 5 k-mers in 3 frames cannot fit; 4 fit one way only
    paths, best = crf.kbest(scores, k=3, targets=tg, target_lengths=torch.tensor([5, 4]), backend=backend)
    assert best[:, 0].eq(-math.inf).all() and paths[:, :, 0].eq(-1).all()
    assert torch.isfinite(best[0, 1]) and best[1:, 1].eq(-math.inf).all() and paths[1:, :, 1].eq(-1).all()
    assert torch.equal(paths[0, :, 1], torch.eye(5, dtype=torch.float64)[:3])
    assert crf.entropy(scores, tg, torch.tensor([5, 4])).eq(0).all()
    s, logp = crf.sample(scores, n=3, targets=tg, target_lengths=torch.tensor([5, 4]), backend=backend)
    assert s[:, :, 0].eq(-1).all() and logp[:, 0].eq(-math.inf).all() and logp[:, 1].eq(0).all()

@DIVERGENCE_BACKENDS
def test_infeasible_targets_give_zero_and_no_nan_gradient(backend):
    crf = CTC_CRF(1, 'NACGT')
    tg, tl = torch.tensor([[1, 2, 3, 4, 1], [1, 2, 3, 4, 0]]), [5, 4]      # sequence 0: 5 k-mers in 3 frames
    for dtype in (torch.float64, torch.float32):
        scores = random_scores(crf, 3, 2, 17, dtype=dtype).requires_grad_()
        for f in (lambda: crf.entropy(scores, tg, tl, backend=backend), lambda: crf.kl(scores, 0.5 * scores, tg, tl, backend=backend),
                  lambda: crf.cross_entropy(scores, 0.5 * scores, tg, tl, backend=backend)):
            value = f()
            g, = torch.autograd.grad(value.sum(), scores)
            assert value[0] == 0 and torch.isfinite(g).all() and g[:, 0].eq(0).all()

# -- samples -------------------------------------------------------------------------------------------------------------

def check_draws(drawn, logprob, n):
    "The counts of the drawn path indices pass the chi-square test against the exact probabilities, and fail it shuffled."
    counts = torch.bincount(drawn, minlength=len(logprob)).double()
    stat, df = chi_square(counts, logprob.exp(), n)
    assert stat < chi_square_bound(df), (stat, df)
    shuffled = logprob.exp()[torch.randperm(len(logprob), generator=torch.Generator().manual_seed(0))]
    assert chi_square(counts, shuffled, n)[0] > chi_square_bound(df)       # the test has power

@DIVERGENCE_BACKENDS
def test_samples_of_the_paths_match_the_exact_probabilities(backend):
    crf, T, n = CTC_CRF(1, 'NACGT'), 2, 20000
    scores = random_scores(crf, T, 2, 12, scale=0.7)
    paths, logp = crf.sample(scores, n=n, generator=torch.Generator().manual_seed(0), backend=backend)
    assert paths.shape == (n, T, 2) and logp.shape == (n, 2)
    cols, _ = all_paths(1, 4, T)
    index = {tuple(p): i for i, p in enumerate(cols.tolist())}
    for b in range(2):
        logprob = path_scores(scores, b, cols).log_softmax(0)
        drawn = torch.tensor([index[tuple(p)] for p in paths[:, :, b].tolist()])       # KeyError: not a path
        close(logp[:, b], logprob[drawn])
        check_draws(drawn, logprob, n)
    # per-frame edge occupancy within 5 sigma of the edge posteriors
    post = crf.posteriors(scores)                                                     # (T, N, n_score)
    freq = torch.nn.functional.one_hot(paths, crf.n_score()).double().mean(0)
    assert ((freq - post).abs() <= 5 * (post * (1 - post) / n).clamp(min=0).sqrt() + 1e-12).all()

@DIVERGENCE_BACKENDS
def test_samples_of_the_alignments_match_the_exact_probabilities(backend):
    crf, T, n = CTC_CRF(1, 'NACGT'), 5, 20000
    scores = random_scores(crf, T, 2, 13, scale=0.7)
    targets, lengths = [[1, 2, 3, 0], [2, 2, 4, 1]], [3, 4]
    tg, tl = torch.tensor(targets), torch.tensor(lengths)
    paths, logp = crf.sample(scores, n=n, generator=torch.Generator().manual_seed(1), targets=tg, target_lengths=tl, backend=backend)
    assert paths.shape == (n, T, 2, 4) and logp.shape == (n, 2)
    for b in range(2):
        acols, left = alignments_of(crf, T, targets[b][:lengths[b]])
        logprob = path_scores(scores, b, acols).log_softmax(0)
        index = {tuple(p): i for i, p in enumerate(left.tolist())}
        assert paths[:, :, b].sum(-1).eq(1).all()
        drawn = torch.tensor([index[tuple(p)] for p in paths[:, :, b].argmax(-1).tolist()])
        close(logp[:, b], logprob[drawn])
        check_draws(drawn, logprob, n)
    # per-frame k-mer occupancy within 5 sigma of the alignment posteriors
    stay, move = crf.prepare_ctc_scores(scores, tg)
    post = ctc_simple.soft_alignments(stay, move, tl)                                 # (T, N, kmers)
    freq = paths.mean(0)
    assert ((freq - post).abs() <= 5 * (post * (1 - post) / n).clamp(min=0).sqrt() + 1e-12).all()

def test_samples_are_reproducible_from_the_generator():
    crf = CTC_CRF(2, 'NACGT')
    scores = random_scores(crf, 6, 3, 14)
    a = crf.sample(scores, n=50, generator=torch.Generator().manual_seed(7))
    b = crf.sample(scores, n=50, generator=torch.Generator().manual_seed(7))
    c = crf.sample(scores, n=50, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    torch.manual_seed(1); d = crf.sample(scores, n=50)
    torch.manual_seed(1); e = crf.sample(scores, n=50)
    assert torch.equal(d[0], e[0])
    # the uniforms are torch.rand((n, T, N), float64) from the generator, on the CPU, as documented
    u = torch.rand((50, 6, 3), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    v = torch.zeros(3, crf.n_states, dtype=torch.float64)
    edges, logp = _sample_edges(crf._Ms(scores), crf.idx.long(), v, v, u)
    assert torch.equal(edges, a[0])                        # (the CPU kernel's, by default; log Z to rounding)
    close(logp, a[1])
    close(a[1], crf.sample(scores.float(), n=50, generator=torch.Generator().manual_seed(7))[1].double(), rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize('state_len, T, T_read', [(2, 9, 3), (3, 6, 2)])
def test_kernel_samples_and_kbest_equal_the_reference(state_len, T, T_read):
    """The CPU kernels and the CUDA kernels (emulated) give the reference's samples for the same uniforms, its
    k best paths, and the same (differentiable) scores, on both lattices, in float64 and float32: the CRF's paths (scaled forward scores) and a batch of reads of
    several lengths (log-space ones), the first of which cannot fit its frames."""
    crf = CTC_CRF(state_len, 'NACGT')
    tg = torch.tensor([[1, 2, 3, 4, 1, 2], [2, 2, 4, 1, 3, 0], [3, 1, 1, 2, 0, 0], [4, 4, 4, 4, 4, 4]])
    tl = torch.tensor([6, 5, 4, state_len])          # 7 - state_len k-mers in T_read = 5 - state_len frames: too many
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        for t, frames in (({}, T), (dict(targets=tg, target_lengths=tl), T_read)):
            x = random_scores(crf, frames, 4, 40 + frames, scale=2.0, dtype=dtype)
            xs = [x.clone().requires_grad_() for _ in range(2)]
            for kernel, ask in (('cpu', lambda b: crf.sample(xs[b != 'reference'], 64, torch.Generator().manual_seed(5), backend=b, **t)),
                                ('cuda', lambda b: crf.sample(xs[b != 'reference'], 64, torch.Generator().manual_seed(5), backend=b, **t)),
                                ('cpu', lambda b: crf.kbest(xs[b != 'reference'], 5, backend=b, **t)),
                                ('cuda', lambda b: crf.kbest(xs[b != 'reference'], 5, backend=b, **t))):
                (p_ref, s_ref), (p_cpu, s_cpu) = (ask(b) for b in ('reference', kernel))
                assert torch.equal(p_cpu, p_ref) and len({str(p) for p in p_cpu[:, :, 2].tolist()}) > 1
                assert torch.isinf(s_cpu[:, 0]).all() == bool(t)
                close(s_cpu, s_ref, rtol=tol, atol=tol)
                (g_ref,), (g_cpu,) = (torch.autograd.grad(torch.where(torch.isfinite(s), s, 0).sum(), xi)
                                      for s, xi in ((s_ref, xs[0]), (s_cpu, xs[1])))
                close(g_cpu, g_ref, rtol=tol, atol=tol)

def test_cuda_kbest_with_fewer_threads_than_states():
    """crf_kbest (emulated) with 32 threads striding over 64 states (each thread's heads reused state after state),
    and a frame with a ZERO_BELOW score: the reference's k best paths and scores, on the paths and on reads."""
    crf = CTC_CRF(3, 'NACGT')
    x = random_scores(crf, 5, 3, 7, scale=2.0)
    x[2, 1, 5] = -1e38                                    # an edge that is no edge
    tg, tl = torch.tensor([[1, 2, 3, 4], [2, 2, 4, 1], [3, 1, 1, 2]]), torch.tensor([4, 4, 3])
    for t in ({}, dict(targets=tg, target_lengths=tl)):
        ref = crf.kbest(x, 6, backend='reference', **t)
        with launch_limits(max_threads=32): got = crf.kbest(x, 6, backend='cuda', **t)
        assert torch.equal(got[0], ref[0])
        close(got[1], ref[1])

@pytest.mark.parametrize('variant', ['split', 'fused'])
def test_cuda_divergence_variants_equal_the_cpu_kernel(variant, monkeypatch):
    """Both variants of the CUDA entropy and KL ($SEQDIST_CRF_DIVERGENCE; emulated), with 32 threads striding over 64
    states: the exact CPU kernel's values and gradients, on the paths and on reads. A variant it does not know: refused."""
    monkeypatch.setenv('SEQDIST_CRF_DIVERGENCE', variant)
    crf = CTC_CRF(3, 'NACGT')
    sp, sq = (random_scores(crf, 5, 3, seed, scale=2.0).requires_grad_() for seed in (8, 9))
    tg, tl = torch.tensor([[1, 2, 3, 4], [2, 2, 4, 1], [3, 1, 1, 2]]), torch.tensor([4, 4, 3])
    for t in ({}, dict(targets=tg, target_lengths=tl)):
        for f, xs in ((lambda b: crf.entropy(sp, backend=b, **t), (sp,)), (lambda b: crf.kl(sp, sq, backend=b, **t), (sp, sq))):
            with launch_limits(max_threads=32): got = f('cuda')
            want = f('cpu')
            close(got, want)
            for a, b in zip(torch.autograd.grad(got.sum(), xs), torch.autograd.grad(want.sum(), xs)): close(a, b)
    monkeypatch.setenv('SEQDIST_CRF_DIVERGENCE', 'both')
    with pytest.raises(ValueError, match="SEQDIST_CRF_DIVERGENCE must be 'split' or 'fused'"):
        crf.entropy(sp, backend='cuda')

def test_float32_no_grad_and_a_single_frame():
    crf = CTC_CRF(1, 'NACGT')
    scores = random_scores(crf, 1, 2, 15, dtype=torch.float32).requires_grad_()
    cols, _ = all_paths(1, 4, 1)
    h = crf.entropy(scores)
    assert h.dtype == torch.float32
    close(h.double(), torch.stack([entropy_kl_ce(path_scores(scores.detach().double(), b, cols), path_scores(scores.detach().double(), b, cols))[0]
                                   for b in range(2)]), rtol=1e-5, atol=1e-6)
    with torch.no_grad(): assert not crf.kbest(scores, k=2)[1].requires_grad
    assert crf.kbest(scores, k=2)[1].requires_grad

# -- bad inputs ----------------------------------------------------------------------------------------------------------

def test_bad_inputs_are_clear_errors():
    crf = CTC_CRF(1, 'NACGT')
    scores = random_scores(crf, 3, 2, 16)
    tg, tl = torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 2])
    cases = [
        (lambda: crf.kbest(scores, k=0), ValueError, 'k must be an int in \\[1, 16\\]'),
        (lambda: crf.kbest(scores, k=17), ValueError, 'k must be'),
        (lambda: crf.kbest(scores, k=2.0), ValueError, 'k must be'),
        (lambda: crf.sample(scores, n=0), ValueError, 'n must be a positive int'),
        (lambda: crf.sample(scores, n=True), ValueError, 'n must be'),
        (lambda: crf.sample(scores, generator=3), TypeError, 'generator must be'),
        (lambda: crf.kl(scores, scores[:2]), ValueError, 'same shape'),
        (lambda: crf.cross_entropy(scores, scores[..., :-1]), ValueError, 'same shape'),
        (lambda: crf.entropy(scores[..., :-1]), ValueError, 'scores must be \\(T, N, 20\\)'),
        (lambda: crf.entropy(scores[:0]), ValueError, 'at least one frame'),
        (lambda: crf.entropy(scores.long()), TypeError, 'floating-point'),
        (lambda: crf.entropy(scores, tg), ValueError, 'targets and target_lengths go together'),
        (lambda: crf.entropy(scores, tg[:1], tl), ValueError, 'targets must be an integer tensor \\(N, L\\) = \\(2, L\\)'),
        (lambda: crf.entropy(scores, tg.double(), tl), ValueError, 'targets must be an integer'),
        (lambda: crf.entropy(scores, tg + 1, tl), ValueError, 'bases in \\[1, 4\\]'),
        (lambda: crf.entropy(scores, tg, torch.tensor([2, 3])), ValueError, 'target_lengths must be in \\[state_len, L\\]'),
        (lambda: crf.entropy(scores, tg, torch.tensor([2])), ValueError, 'target_lengths must be 2 integers'),
        (lambda: crf.kbest(scores, backend='fast'), ValueError, 'backend must be'),
        (lambda: crf.entropy(scores, backend='fast'), ValueError, 'backend must be'),
    ]
    for f, error, message in cases:
        with pytest.raises(error, match=message): f()
    assert crf.entropy(scores, backend='reference').shape == (2,)

def test_fast_entropy_vouches_only_where_it_cannot_have_cancelled():
    """The expectation-semiring kernel (log Z - E[score]) keeps the sequences where its rounding bound is far below H and
    hands a peaky one (H tiny beside E[score]) to the exact kernel; the mixed batch's entropies and gradients equal the
    reference's, in float64 and float32."""
    from seqdist.crf import _fast_entropy
    crf, T, N = CTC_CRF(2, 'NACGT'), 20, 5
    s = random_scores(crf, T, N, 30)
    s[:, 2] *= 60                                          # sequence 2: one path almost certain
    lat = crf._lattice(s, None, None)
    value, logz, grad, good = _fast_entropy(lat.Ms, lat.idx, lat.v0, lat.vT, True)
    assert good.tolist() == [True, True, False, True, True]
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        got = {}
        for backend in ('cpu', 'reference'):
            x = s.to(dtype).requires_grad_()
            h = crf.entropy(x, backend=backend)
            got[backend] = h.detach().double(), torch.autograd.grad((h * torch.arange(1.0, N + 1)).sum(), x)[0].double()
        assert got['cpu'][0][2] < 1e-3 * got['cpu'][0][0]
        for a, b in zip(got['cpu'], got['reference']): torch.testing.assert_close(a, b, rtol=tol, atol=tol)

def test_ctc_crf_alignments_object_against_enumeration():
    """CTC_CRFAlignments, the paths' distribution and a read's alignments' posterior: log_prob and marginals equal the
    enumeration's, -inf for what is not a path; argmax, topk, entropy, kl and samples as the CTC_CRF methods give them."""
    from seqdist.crf import CTC_CRFAlignments
    crf, T, N = CTC_CRF(1, 'NACGT'), 3, 2
    cols, _ = all_paths(1, 4, T)
    sp, sq = random_scores(crf, T, N, 40), random_scores(crf, T, N, 41)
    d, e = CTC_CRFAlignments(crf, sp), CTC_CRFAlignments(crf, sq)
    value = cols[:, :, None].expand(-1, -1, N)                       # every path, for both sequences: (P, T, N)
    logp = d.log_prob(value)
    for b in range(N):
        want = path_scores(sp, b, cols).log_softmax(0)
        close(logp[:, b], want)
        occupancy = torch.zeros(T, crf.n_score(), dtype=torch.float64).index_put_(
            (torch.arange(T).expand(len(cols), T), cols), want.exp()[:, None].expand(-1, T), accumulate=True)
        close(d.marginals[:, b], occupancy)
        assert torch.equal(d.argmax[:, b], cols[want.argmax()])
    bad = value[:1].clone(); bad[0, 0], bad[0, 1] = 0, 5             # a stay in state 0, then a stay in state 1: no path
    assert d.log_prob(bad).eq(-math.inf).all() and d.log_prob(value[:1] + 100).eq(-math.inf).all()
    close(d.entropy(), crf.entropy(sp)); close(d.kl(e), crf.kl(sp, sq)); close(d.cross_entropy(e), crf.cross_entropy(sp, sq))
    assert torch.equal(d.topk(3)[0], crf.kbest(sp, 3)[0])
    x = d.sample((2, 3), generator=torch.Generator().manual_seed(0))
    assert x.shape == (2, 3, T, N)
    close(d.log_prob(x).flatten(0, 1), crf.sample(sp, 6, torch.Generator().manual_seed(0))[1])
    # a read's alignments
    target, tg, tl = [1, 3], torch.tensor([[1, 3], [1, 3]]), torch.tensor([2, 2])
    acols, left = alignments_of(crf, T, target)
    da = CTC_CRFAlignments(crf, sp, tg, tl)
    onehot = torch.nn.functional.one_hot(left, 2).double()[:, :, None].expand(-1, -1, N, -1)    # (P, T, N, k-mers)
    logp = da.log_prob(onehot)
    for b in range(N):
        want = path_scores(sp, b, acols).log_softmax(0)
        close(logp[:, b], want)
        close(da.marginals[:, b], (want.exp()[:, None, None] * onehot[:, :, b]).sum(0))
    skip = onehot[:1].clone(); skip[0, 0] = torch.tensor([0.0, 1.0])  # starts in the second k-mer: not an alignment
    assert da.log_prob(skip).eq(-math.inf).all()
    close(da.entropy(), crf.entropy(sp, tg, tl))
    close(da.log_partition, crf.ctc_loss(sp, tg, tl, reduction='none', normalise_scores=False) * -tl)
