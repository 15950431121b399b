"""forced_align's confidences, wildcard and label priors against brute-force enumeration of every alignment of tiny
lattices, on the CPU and reference paths; the default outputs unchanged; bad options rejected with their names."""
import math
import pytest, torch
from seqdist.ctc import forced_align

def alignments(ext, T):
    "Every state path of T frames through the extended labels `ext` (2L+1 states): lists of states."
    S = len(ext)
    def walk(path):
        if len(path) == T:
            if path[-1] >= S - 2: yield path
            return
        s = path[-1]
        for k in (0, 1, 2):
            r = s + k
            if r >= S or (k == 2 and (ext[r] == ext[0] or ext[r] == ext[s])): continue   # skip: labels that differ
            yield from walk(path + [r])
    if T == 0: return [[]] if S == 1 else []
    return [p for s0 in range(min(2, S)) for p in walk([s0])]

def states_of(labels, blank):
    "The state path of an alignment's labels: the k-th run of a label other than the blank is token k, state 2k+1."
    states, j = [], -1
    for t, c in enumerate(labels):
        if c != blank and (t == 0 or labels[t - 1] != c): j += 1
        states.append(2 * j + 1 if c != blank else 2 * j + 2)
    return states

def brute_force(em, target, T, blank, labels):
    """Check that `labels` is a best alignment of em[:T] (T, C') by enumerating all of them, and return each token's
    confidence along it: the exact posterior of its state at each of the path's frames on it (the sum over all
    alignments), averaged over those frames. Ties (the wildcard makes them) are allowed: any best path will do."""
    ext = [blank]
    for c in target: ext += [c, blank]
    paths = alignments(ext, T)
    score = torch.tensor([sum(float(em[t, ext[s]]) for t, s in enumerate(p)) for p in paths], dtype=torch.float64)
    best = states_of(labels, blank)
    assert best in paths, (labels, target)
    assert abs(float(score[paths.index(best)]) - float(score.max())) <= 1e-12, (labels, target)
    weight = (score - score.logsumexp(0)).exp()
    conf = []
    for j in range(len(target)):
        frames = [t for t, s in enumerate(best) if s == 2 * j + 1]
        gamma = [sum(float(w) for p, w in zip(paths, weight) if p[t] == 2 * j + 1) for t in frames]
        conf.append(sum(gamma) / len(gamma))
    return [ext[s] for s in best], conf

def random_batch(g, N=4, T=6, C=4, L=3, blank=0, star=None):
    "Variable lengths, repeats, a length-0 target; targets that fit; star (if given) in some of them."
    lp = torch.randn(N, T, C, generator=g, dtype=torch.float64).log_softmax(-1)
    vocab = torch.tensor([c for c in range(C) if c != blank] + ([star] if star is not None else []))
    targets = vocab[torch.randint(0, len(vocab), (N, L), generator=g)]
    targets[1, 1] = targets[1, 0]                          # a repeat
    tl = torch.tensor([0, 2, 3, 1][:N])
    il = torch.tensor([T, T, T - 1, 2][:N])
    return lp, targets, il, tl

def check(lp, targets, il, tl, blank, labels, scores, conf, emissions, model, star=None):
    "Each sequence's outputs against brute force on `emissions` (N, T, C'), scores from `model` (N, T, C')."
    N, T, _ = lp.shape
    assert labels.shape == scores.shape == (N, T) and conf.shape == targets.shape
    assert ((conf >= 0) & (conf <= 1 + 1e-12)).all()
    for n in range(N):
        target = [int(c) if c != star else lp.shape[2] for c in targets[n, :tl[n]]]
        got = [lp.shape[2] if c == star else c for c in labels[n, :il[n]].tolist()]
        want, want_conf = brute_force(emissions[n], target, int(il[n]), blank, got)
        assert got == want and (labels[n, il[n]:] == blank).all()
        want_scores = torch.tensor([float(model[n, t, c]) for t, c in enumerate(want)], dtype=torch.float64)
        torch.testing.assert_close(scores[n, :il[n]], want_scores, rtol=0, atol=0)
        assert (scores[n, il[n]:] == 0).all()
        torch.testing.assert_close(conf[n, :tl[n]], torch.tensor(want_conf, dtype=torch.float64), rtol=1e-9, atol=1e-12)
        assert (conf[n, tl[n]:] == 0).all()

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
@pytest.mark.parametrize('seed', range(3))
def test_confidence_equals_brute_force(seed, backend):
    g = torch.Generator().manual_seed(seed)
    blank = seed % 2 * 2                                   # blanks 0 and 2
    lp, targets, il, tl = random_batch(g, blank=blank)
    labels, scores, conf = forced_align(lp, targets, il, tl, blank, backend=backend, return_confidence=True)
    check(lp, targets, il, tl, blank, labels, scores, conf, lp, lp)
    assert torch.equal(labels, forced_align(lp, targets, il, tl, blank)[0])

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
@pytest.mark.parametrize('seed', range(3))
def test_star_and_priors_equal_brute_force(seed, backend):
    "The best alignment under log_probs - scale * priors, with the wildcard's column penalty + the best non-blank."
    g = torch.Generator().manual_seed(10 + seed)
    C, blank, star = 4, 0, [4, 9, 4][seed]
    lp, targets, il, tl = random_batch(g, C=C, star=star)
    priors = torch.randn(C, generator=g, dtype=torch.float64)
    scale, penalty = [0.0, 0.7, 1.3][seed], [0.0, -0.5, 0.4][seed]
    labels, scores, conf = forced_align(lp, targets, il, tl, blank, backend=backend, return_confidence=True, star=star,
                                        star_penalty=penalty, label_log_priors=priors, prior_scale=scale)
    adjusted = lp - scale * priors
    best = lambda x: x[..., 1:].amax(-1, keepdim=True)
    emissions = torch.cat([adjusted, penalty + best(adjusted)], -1)
    model = torch.cat([lp, best(lp)], -1)
    check(lp, targets, il, tl, blank, labels, scores, conf, emissions, model, star)

@pytest.mark.parametrize('seed', range(2))
def test_priors_alone_equal_brute_force(seed):
    g = torch.Generator().manual_seed(20 + seed)
    lp, targets, il, tl = random_batch(g)
    priors = torch.randn(4, generator=g, dtype=torch.float64)
    labels, scores, conf = forced_align(lp, targets, il, tl, label_log_priors=priors, prior_scale=2.0,
                                        return_confidence=True)
    check(lp, targets, il, tl, 0, labels, scores, conf, lp - 2.0 * priors, lp)

def test_defaults_unchanged():
    "No option: two outputs, bitwise those of explicit defaults; a float32 batch as callers pass it."
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(3, 12, 6, generator=g).log_softmax(-1)
    targets, il, tl = torch.tensor([[1, 2, 2], [3, 4, 0], [5, 0, 0]]), torch.tensor([12, 9, 4]), torch.tensor([3, 2, 1])
    out = forced_align(lp, targets, il, tl)
    again = forced_align(lp, targets, il, tl, return_confidence=False, star=None, star_penalty=0.0,
                         label_log_priors=None, prior_scale=1.0)
    assert len(out) == 2 and all(torch.equal(a, b) for a, b in zip(out, again))
    labels, scores, conf = forced_align(lp, targets, il, tl, return_confidence=True)
    assert torch.equal(labels, out[0]) and torch.equal(scores, out[1])
    assert conf.shape == (3, 3) and conf.dtype == torch.float32 and conf[1, 2] == 0 and (conf[:, 0] > 0).all()
    zero = forced_align(lp, targets, il, tl, label_log_priors=torch.zeros(6))   # priors of 0 change nothing
    assert torch.equal(zero[0], out[0]) and torch.equal(zero[1], out[1])

def test_star_keeps_its_id_and_absorbs_an_unknown_token():
    "A frame run the transcript leaves out is taken by the wildcard, whose id comes back in the labels."
    lp = torch.full((1, 5, 4), -6.0)
    for t, c in enumerate([1, 0, 3, 0, 2]): lp[0, t, c] = 0.0
    labels, scores = forced_align(lp.log_softmax(-1), torch.tensor([[1, 7, 2]]), star=7)
    assert labels[0].tolist() == [1, 0, 7, 0, 2] and scores[0, 2] == lp.log_softmax(-1)[0, 2, 3]

BAD = [
    (dict(star=2), ValueError, 'star must be an int >= C'),
    (dict(star=True), ValueError, 'star must be'),
    (dict(star=4.0), ValueError, 'star must be'),
    (dict(star=4, star_penalty=math.nan), ValueError, 'star_penalty'),
    (dict(star=4, star_penalty='0'), TypeError, 'star_penalty'),
    (dict(label_log_priors=torch.zeros(3)), ValueError, 'label_log_priors must be a float tensor of shape'),
    (dict(label_log_priors=torch.zeros(4, dtype=torch.long)), ValueError, 'label_log_priors'),
    (dict(label_log_priors=torch.tensor([0.0, -math.inf, 0.0, 0.0])), ValueError, 'label_log_priors must be finite'),
    (dict(label_log_priors=torch.zeros(4), prior_scale=math.inf), ValueError, 'prior_scale'),
    (dict(return_confidence=1), ValueError, 'return_confidence'),
]

@pytest.mark.parametrize('kw,error,message', BAD)
def test_bad_options(kw, error, message):
    with pytest.raises(error, match=message):
        forced_align(torch.randn(1, 6, 4).log_softmax(-1), torch.tensor([[1, 2]]), **kw)

def test_bad_targets_with_star_and_infeasible_ones():
    lp = torch.randn(2, 4, 4).log_softmax(-1)
    with pytest.raises(ValueError, match=r'or star = 5, got \[4\]'):   # C itself is not the star here
        forced_align(lp, torch.tensor([[1, 4], [1, 5]]), star=5)
    forced_align(lp, torch.tensor([[1, 9], [1, 5]]), target_lengths=[1, 2], star=5)   # padding is not read
    with pytest.raises(ValueError, match='sequence 1 has 3 target labels and 1 adjacent repeats'):
        forced_align(lp, torch.tensor([[1, 5, 2], [5, 5, 2]]), input_lengths=[4, 3], star=5)

def test_options_on_the_cuda_backend_equal_the_cpu():
    "The wildcard, the priors and the confidence through the CUDA kernels (emulated here) give the CPU's outputs, float32."
    g = torch.Generator().manual_seed(30)
    lp = torch.randn(3, 16, 5, generator=g).log_softmax(-1)
    targets, il, tl = torch.tensor([[1, 7, 2], [3, 4, 0], [7, 0, 0]]), torch.tensor([16, 11, 6]), torch.tensor([3, 2, 1])
    kw = dict(return_confidence=True, star=7, star_penalty=-0.3, label_log_priors=torch.randn(5, generator=g), prior_scale=0.5)
    cpu, cuda = (forced_align(lp, targets, il, tl, backend=b, **kw) for b in ('cpu', 'cuda'))
    assert torch.equal(cpu[0], cuda[0]) and torch.equal(cpu[1], cuda[1]) and cpu[2].dtype == cuda[2].dtype == torch.float32
    torch.testing.assert_close(cpu[2], cuda[2], rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_degenerate_lengths(backend):
    "No frames, one frame, no target, a target that needs every frame; with the wildcard and priors too."
    g = torch.Generator().manual_seed(7)
    lp = torch.randn(5, 3, 4, generator=g, dtype=torch.float64).log_softmax(-1)
    targets = torch.tensor([[1, 2], [3, 0], [3, 0], [2, 4], [4, 4]])
    il, tl = torch.tensor([0, 1, 1, 2, 3]), torch.tensor([0, 0, 1, 2, 2])
    labels, scores, conf = forced_align(lp, targets, il, tl, backend=backend, return_confidence=True, star=4,
                                        label_log_priors=torch.randn(4, generator=g, dtype=torch.float64))
    assert labels[3, :2].tolist() == [2, 4] and labels[4].tolist() == [4, 0, 4] and (labels[0] == 0).all()
    assert conf[0].tolist() == [0, 0] and conf[1].tolist() == [0, 0]       # one path: every posterior is 1
    torch.testing.assert_close(conf[2:], torch.tensor([[1.0, 0], [1, 1], [1, 1]], dtype=torch.float64))
    assert labels[2, 0] == 3 and scores[2, 0] == lp[2, 0, 3] and scores[0].tolist() == [0, 0, 0]
