"""The graph lattice (seqdist.graph): the reference and the CPU kernel against the enumeration of every path of small
random graphs (with epsilon arcs), CTC given as a graph against PyTorch's ctc_loss and forced_align, every question of
GraphLattice against enumeration, and the errors of malformed graphs and bad inputs."""
import math
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import seqdist.graph as G
from seqdist.graph import Graph, GraphLattice, graph_loss, graph_logz, ctc_topology, compact_ctc_topology, compose_labels, ctc_graph
from seqdist.graph import enumerate_paths, path_score, random_graph
from seqdist.core import Log, Max, Entropy, KL, CrossEntropy

def brute(g, x):
    "log Z, the best score and the path scores (float64) of graph g through emissions x (T, C), by enumeration."
    paths = enumerate_paths(g, len(x))
    s = torch.stack([path_score(g, x, a, f) for a, f in paths]) if paths else torch.zeros(0, dtype=torch.float64)
    return paths, s

def small(gen, eps=0.3, max_states=6, max_arcs=10, C=3):
    return random_graph(int(torch.randint(1, max_states, (1,), generator=gen)), int(torch.randint(1, max_arcs, (1,), generator=gen)), C, eps, gen)

@pytest.mark.parametrize("seed", range(2))
def test_log_z_best_path_and_gradients_equal_enumeration(seed):
    gen, checked = torch.Generator().manual_seed(seed), 0
    for _ in range(25):
        g = small(gen)
        T = int(torch.randint(0, 6, (1,), generator=gen))
        x = torch.randn(T, 1, 3, generator=gen, dtype=torch.float64)
        paths, s = brute(g, x[:, 0])
        if len(paths) > 300: continue                                 # (the enumeration's autograd is slow)
        for backend in ('cpu', 'reference'):
            z = graph_logz(x, torch.tensor([T]), g, backend=backend)[0]
            zm = graph_logz(x, torch.tensor([T]), g, semiring='Max', backend=backend)[0]
            if not paths:
                assert z == -math.inf and zm == -math.inf
                continue
            assert torch.allclose(z, s.logsumexp(0), rtol=0, atol=1e-10) and torch.allclose(zm, s.max(), rtol=0, atol=1e-10)
            # the gradient w.r.t. the emissions, the arc scores and the final scores: the enumeration's, by autograd
            xs, w, f = x.clone().requires_grad_(), g.scores.clone().requires_grad_(), g.final_scores.clone().requires_grad_()
            g2 = Graph(g.src, g.dst, g.labels, w, g.start, g.finals, f, num_states=g.num_states)
            got = torch.autograd.grad(graph_logz(xs, torch.tensor([T]), g2, backend=backend)[0], (xs, w, f), allow_unused=True)
            xb, wb, fb = x.clone().requires_grad_(), g.scores.clone().requires_grad_(), g.final_scores.clone().requires_grad_()
            s2 = torch.stack([path_score(g, xb[:, 0], a, i, wb, fb) for a, i in paths]).logsumexp(0)
            want = torch.autograd.grad(s2, (xb, wb, fb), allow_unused=True)
            for a, b, like in zip(got, want, (xs, w, f)):
                a, b = (torch.zeros_like(like) if v is None else v for v in (a, b))
                assert torch.allclose(a, b, rtol=0, atol=1e-10)
            checked += 1
        lat = GraphLattice(x, torch.tensor([T]), g)
        if paths:
            best = lat.argmax[0]
            best = best[best >= 0].tolist()
            final = {tuple(a): i for a, i in paths}
            assert tuple(best) in final and abs(float(path_score(g, x[:, 0], best, final[tuple(best)]) - s.max())) < 1e-10
    assert checked > 20

def test_a_graph_with_no_arcs_and_the_empty_input():
    g = Graph([], [], [], start=0, finals=[0])
    assert graph_logz(torch.zeros(0, 1, 2), torch.tensor([0]), g)[0] == 0
    assert graph_logz(torch.zeros(3, 1, 2), torch.tensor([0]), g)[0] == 0       # input length 0: the empty path
    assert graph_logz(torch.zeros(3, 1, 2), torch.tensor([1]), g)[0] == -math.inf

@pytest.mark.parametrize('segment,wide', [(G.SEGMENT_BYTES, False), (64, False), (64, True)])
def test_ragged_batches_kernel_equals_reference(monkeypatch, segment, wide):
    """Several graphs shared by some sequences, uneven lengths, whole and segmented backward passes (sqrt(T) checkpoints):
    in scaled space, and (`wide`: an emission 500 nats below its frame's best) in log space."""
    monkeypatch.setattr(G, 'SEGMENT_BYTES', segment)
    gen = torch.Generator().manual_seed(7)
    for _ in range(8):
        graphs = [random_graph(int(torch.randint(2, 8, (1,), generator=gen)), 14, 4, 0.4, gen) for _ in range(3)]
        ws = [[g.scores.clone().requires_grad_() for g in graphs] for _ in range(2)]
        x = torch.randn(11, 6, 4, generator=gen, dtype=torch.float64)
        if wide: x[3, :, 1] -= 500.0
        lengths = torch.randint(0, 12, (6,), generator=gen)
        out = []
        for backend, w in zip(('cpu', 'reference'), ws):
            gs = [Graph(g.src, g.dst, g.labels, wi, g.start, g.finals, g.final_scores, num_states=g.num_states) for g, wi in zip(graphs, w)]
            xs = x.clone().requires_grad_()
            z = graph_logz(xs, lengths, [gs[n % 3] for n in range(6)], backend=backend)
            torch.where(torch.isfinite(z), z, 0).sum().backward()
            out.append((z.detach(), xs.grad, [torch.zeros_like(wi) if wi.grad is None else wi.grad for wi in w]))
        (zk, gk, wk), (zr, gr, wr) = out
        assert torch.equal(torch.isfinite(zk), torch.isfinite(zr))
        assert torch.allclose(zk[torch.isfinite(zk)], zr[torch.isfinite(zr)], rtol=0, atol=1e-10)
        assert torch.allclose(gk, gr, rtol=0, atol=1e-10) and all(torch.allclose(a, b, rtol=0, atol=1e-10) for a, b in zip(wk, wr))

def test_past_its_budget_the_scaled_kernel_keeps_every_sqrt_t_th_row_and_answers_alike(monkeypatch):
    "A budget of a few bytes: the scaled kernel keeps rows every ~sqrt(T) frames and recomputes segments; log space is not needed."
    gen = torch.Generator().manual_seed(3)
    graphs = [random_graph(6, 16, 5, 0.3, gen) for _ in range(3)]
    lp = torch.randn(40, 6, 5, generator=gen, dtype=torch.float64).log_softmax(-1)
    lengths = torch.tensor([40, 33, 17, 1, 0, 25])
    def run():
        x = lp.clone().requires_grad_()
        z = graph_logz(x, lengths, [graphs[n % 3] for n in range(6)], backend='cpu')
        torch.where(torch.isfinite(z), z, 0).sum().backward()
        return z.detach(), x.grad
    whole = run()
    monkeypatch.setattr(G, 'SEGMENT_BYTES', 64)
    def log_space(*args, **kw): raise AssertionError("redone in log space")
    monkeypatch.setattr(G, '_graph_logz_cpu', log_space)
    segmented = run()
    assert torch.isfinite(whole[0]).sum() >= 3
    assert torch.equal(torch.isfinite(whole[0]), torch.isfinite(segmented[0]))
    assert torch.allclose(whole[0], segmented[0], rtol=1e-12, atol=0, equal_nan=True)
    assert torch.allclose(whole[1], segmented[1], rtol=0, atol=1e-12)

@pytest.mark.parametrize('dtype,tol', [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_ctc_as_a_graph_equals_ctc_loss(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    T, N, C = 60, 6, 9
    logits = torch.randn(T, N, C, generator=gen, dtype=dtype, requires_grad=True)
    targets, tl = torch.randint(1, C, (N, 15), generator=gen), torch.tensor([0, 1, 5, 15, 9, 12])
    il = torch.tensor([60, 60, 30, 59, 25, 60])
    ours = graph_loss(logits.log_softmax(-1), il, ctc_graph(targets, tl), reduction='none')
    theirs = F.ctc_loss(logits.log_softmax(-1), targets, il, tl, reduction='none')
    assert torch.allclose(ours, theirs, rtol=tol, atol=0)
    g1, = torch.autograd.grad(ours.sum(), logits)
    g2, = torch.autograd.grad(theirs.sum(), logits)
    assert (g1 - g2).abs().max() <= tol * 10 * g2.abs().max()
    # the composition builds the same lattice as ctc_graph; mean reduces over the batch
    composed = [compose_labels(ctc_topology(C), targets[n, :tl[n]]) for n in range(N)]
    assert torch.allclose(graph_loss(logits.log_softmax(-1), il, composed, reduction='none'), ours)
    assert torch.allclose(graph_loss(logits.log_softmax(-1), il, composed), ours.mean())

def test_compact_ctc_topology():
    "Without a label repeated in a row, compact CTC's paths are CTC's; with one it has more (the repeat read twice)."
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(20, 1, 5, generator=gen, dtype=torch.float64).log_softmax(-1)
    for y, more in (([1, 2, 3, 1], False), ([2, 2, 4], True)):
        z_ctc = graph_logz(lp, torch.tensor([20]), compose_labels(ctc_topology(5), y))
        z_compact = graph_logz(lp, torch.tensor([20]), compose_labels(compact_ctc_topology(5), y))
        assert (z_compact > z_ctc + 1e-6).item() if more else torch.allclose(z_compact, z_ctc, rtol=0, atol=1e-10)

def test_viterbi_equals_forced_align():
    from seqdist.ctc import forced_align
    gen = torch.Generator().manual_seed(3)
    T, N, C = 50, 8, 6
    lp = torch.randn(T, N, C, generator=gen, dtype=torch.float64).log_softmax(-1)
    targets, tl = torch.randint(1, C, (N, 10), generator=gen), torch.randint(1, 11, (N,), generator=gen)
    graphs = ctc_graph(targets, tl)
    best = GraphLattice(lp, torch.full((N,), T), graphs).argmax
    for n in range(N):
        fa, _ = forced_align(lp[:, n][None], targets[n:n + 1, :tl[n]])
        assert torch.equal(graphs[n].labels[best[n]], fa[0])
    assert torch.allclose(graph_logz(lp, torch.full((N,), T), graphs, semiring='Max'),
                          torch.stack([lp[torch.arange(T), n, graphs[n].labels[best[n]]].sum() for n in range(N)]))

def test_gradcheck():
    gen = torch.Generator().manual_seed(4)
    g = random_graph(4, 10, 3, 0.3, gen)
    x = torch.randn(5, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    w, f = g.scores.clone().requires_grad_(), g.final_scores.clone().requires_grad_()
    def fn(x, w, f):
        z = graph_logz(x, torch.tensor([5, 4]), Graph(g.src, g.dst, g.labels, w, g.start, g.finals, f, num_states=4))
        return torch.where(torch.isfinite(z), z, 0)
    assert torch.autograd.gradcheck(fn, (x, w, f))

def test_infeasible_nan_and_dtypes():
    one = Graph.from_arcs([(0, 1, 0, 0.0)], finals=[1])
    x = torch.zeros(2, 2, 1, requires_grad=True)
    loss = graph_loss(x, torch.tensor([2, 1]), one, reduction='none')
    assert loss[0] == math.inf and loss[1] == 0
    z = graph_loss(x, torch.tensor([2, 1]), one, reduction='sum', zero_infinity=True)
    z.backward()
    assert z == 0 and torch.isfinite(x.grad).all() and x.grad[:, 0].abs().sum() == 0
    nan = torch.zeros(2, 2, 1)
    nan[0, 1, 0] = math.nan
    z = graph_logz(nan, torch.tensor([2, 1]), Graph.from_arcs([(0, 0, 0, 0.0)], finals=[0]))
    assert torch.isnan(z[1]) and z[0] == 0
    assert graph_logz(torch.zeros(2, 1, 1, dtype=torch.float64), torch.tensor([2]), one).dtype == torch.float64

@pytest.mark.parametrize('backend', ['cpu', 'reference'])
def test_lattice_questions_equal_enumeration(backend):
    gen, n = torch.Generator().manual_seed(9), 0
    for _ in range(15):
        g = small(gen, max_states=5)
        gq = Graph(g.src, g.dst, g.labels, torch.randn(g.num_arcs, generator=gen, dtype=torch.float64), g.start, g.finals,
                   torch.randn(len(g.finals), generator=gen, dtype=torch.float64), num_states=g.num_states)
        T = int(torch.randint(1, 5, (1,), generator=gen))
        lp, lq = torch.randn(2, T, 2, 3, generator=gen, dtype=torch.float64)
        lengths = torch.tensor([T, T - 1])
        p, q = GraphLattice(lp, lengths, g, backend=backend), GraphLattice(lq, lengths, gq, backend=backend)
        H, D, CE, M, A = p.entropy(), p.kl(q), p.cross_entropy(q), p.marginals, p.arc_marginals
        for b in range(2):
            paths = enumerate_paths(g, int(lengths[b]))
            if not paths:
                assert p.log_partition[b] == -math.inf
                continue
            sp = torch.stack([path_score(g, lp[:, b], a, f) for a, f in paths])
            sq = torch.stack([path_score(gq, lq[:, b], a, f) for a, f in paths])
            logp, logq = sp - sp.logsumexp(0), sq - sq.logsumexp(0)
            pr = logp.exp()
            assert abs(float(H[b] + (pr * logp).sum())) < 1e-10
            assert abs(float(D[b] - (pr * (logp - logq)).sum())) < 1e-10
            assert abs(float(CE[b] + (pr * logq).sum())) < 1e-10
            m, am = torch.zeros(T, 3, dtype=torch.float64), torch.zeros(g.num_arcs, dtype=torch.float64)
            for (arcs, f), w in zip(paths, pr):
                t = 0
                for a in arcs:
                    am[a] += w
                    if g.labels[a] >= 0: m[t, g.labels[a]] += w; t += 1
            assert torch.allclose(M[:, b], m, rtol=0, atol=1e-10) and torch.allclose(A[b, :g.num_arcs], am, rtol=0, atol=1e-10)
            value = torch.full((len(paths), 2, p.argmax.shape[1]), -1)
            for i, (a, f) in enumerate(paths): value[i, b, :len(a)] = torch.tensor(a, dtype=torch.int64)
            assert torch.allclose(p.log_prob(value)[:, b], logp, rtol=0, atol=1e-10)
            n += 1
    assert n > 10

def test_log_prob_of_what_is_not_a_path():
    g = Graph.from_arcs([(0, 0, 0, 0.0), (0, 1, 1, 0.0), (1, 1, 1, 0.0)], finals=[1])
    lat = GraphLattice(torch.randn(3, 1, 2).log_softmax(-1), torch.tensor([3]), g)
    for path in ([0, 1, 2], [1, 2, 2], [0, 0, 1]):
        assert lat.log_prob(torch.tensor([[path]]))[0, 0] > -math.inf
    for path in ([0, 0, 0], [2, 2, 2], [0, 1, -1], [-1, 0, 1], [0, 1, 7], [0, 1, 2, 2][:3][::-1]):
        assert lat.log_prob(torch.tensor([[path]]))[0, 0] == -math.inf, path

@pytest.mark.parametrize('backend,n', [('cpu', 4000), ('reference', 600)])
def test_samples_follow_the_posterior(backend, n):
    gen = torch.Generator().manual_seed(3)
    g = random_graph(4, 8, 3, 0.3, gen)
    lp = torch.randn(3, 1, 3, generator=gen, dtype=torch.float64)
    paths, s = brute(g, lp[:, 0])
    assert len(paths) > 3
    pr = (s - s.logsumexp(0)).exp()
    draws = GraphLattice(lp, torch.tensor([3]), g, backend=backend).sample((n,), generator=torch.Generator().manual_seed(0))[:, 0]
    index = {tuple(a): i for i, (a, f) in enumerate(paths)}
    counts = torch.zeros(len(paths), dtype=torch.float64)
    for d in draws: counts[index[tuple(d[d >= 0].tolist())]] += 1
    sd = (pr * (1 - pr) / n).sqrt()
    assert ((counts / n - pr).abs() <= 5 * sd + 1e-3).all()

def test_every_sample_is_a_path():
    "Ragged batches of graphs with many epsilon arcs, uneven lengths (0 too): each draw a path (or all -1 where none fits)."
    gen = torch.Generator().manual_seed(9)
    for _ in range(20):
        gs = [random_graph(int(torch.randint(2, 7, (1,), generator=gen)), 12, 4, 0.5, gen) for _ in range(3)]
        lp = torch.randn(7, 3, 4, generator=gen, dtype=torch.float64)
        lat = GraphLattice(lp, torch.randint(0, 8, (3,), generator=gen), gs)
        x = lat.sample((30,), generator=gen)
        ok, z = lat.log_prob(x) > -math.inf, lat.log_partition
        for n in range(3): assert (x[:, n] == -1).all() if z[n] == -math.inf else ok[:, n].all()

def test_graph_formats():
    text = "0 1 2 2 0.5\n0 0 1 1 0.25\n1 2 0 0\n1 1 3 3 1.0\n2 0.75\n1\n"
    g = Graph.from_openfst(text)
    assert g.num_states == 3 and g.start == 0 and g.labels.tolist() == [1, 0, -1, 2]
    assert torch.allclose(g.scores, torch.tensor([-0.5, -0.25, 0.0, -1.0])) and g.finals.tolist() == [2, 1]
    assert torch.allclose(g.final_scores, torch.tensor([-0.75, 0.0]))
    acc = Graph.from_openfst("0 1 2 0.5\n1 0.1\n", acceptor=True)
    assert acc.labels.tolist() == [1] and torch.allclose(acc.final_scores, torch.tensor([-0.1]))
    with pytest.raises(ValueError, match='acceptor=True'): Graph.from_openfst("0 1 2 0.5\n1\n")
    # k2's arc tensor: final arcs (label -1) into the last state become final scores
    arcs = torch.tensor([[0, 1, 1, 0], [1, 1, 2, 0], [1, 2, -1, 0], [0, 2, -1, 0]], dtype=torch.int32)
    arcs[:, 3] = torch.tensor([-0.5, -1.0, -0.25, -2.0]).view(torch.int32)
    k = Graph.from_k2(arcs)
    assert k.num_states == 2 and k.finals.tolist() == [0, 1] and torch.allclose(k.final_scores, torch.tensor([-2.0, -0.25]))
    lp = torch.randn(3, 1, 3).log_softmax(-1)
    want = torch.logsumexp(torch.stack([-0.5 + lp[0, 0, 1] - 1.0 + lp[1, 0, 2] - 1.0 + lp[2, 0, 2] - 0.25]), 0)
    assert torch.allclose(graph_logz(lp, torch.tensor([3]), k)[0], want)

@pytest.mark.parametrize('make,match', [
    (lambda: Graph([0, 1], [1, 0], [-1, -1], finals=[1]), 'epsilon arcs .* cycle'),
    (lambda: Graph([0], [3], [0], finals=[1], num_states=2), 'dst must hold states in'),
    (lambda: Graph([0], [1], [0], finals=[]), 'finals'),
    (lambda: Graph([0], [1], [0]), 'finals'),
    (lambda: Graph([0], [1], [-2], finals=[1]), 'labels must be'),
    (lambda: Graph([0, 1], [1], [0], finals=[1]), 'dst must have one entry per arc'),
    (lambda: Graph([0.5], [1], [0], finals=[1]), 'src must hold integers'),
    (lambda: Graph([0], [1], [0], scores=[1.0, 2.0], finals=[1]), 'scores must have shape'),
    (lambda: Graph([0], [1], [0], finals=[1], final_scores=[0.0, 1.0]), 'final_scores must have shape'),
    (lambda: Graph([0], [1], [0], start=5, finals=[1], num_states=2), 'start must be a state'),
    (lambda: compose_labels(ctc_topology(3), [1, 5]), 'no path'),
    (lambda: ctc_topology(0), 'C must be'),
])
def test_malformed_graphs_are_named(make, match):
    with pytest.raises((ValueError, TypeError), match=match): make()

def test_bad_calls_are_named():
    g = ctc_graph(torch.tensor([1, 2]))
    lp = torch.randn(5, 2, 3).log_softmax(-1)
    with pytest.raises(ValueError, match='label 3'): graph_loss(lp, torch.tensor([5, 5]), ctc_graph(torch.tensor([1, 3])))
    with pytest.raises(ValueError, match='graphs must be one Graph or a list of N = 2'): graph_loss(lp, torch.tensor([5, 5]), [g])
    with pytest.raises(ValueError, match='input_lengths'): graph_loss(lp, torch.tensor([5, 6]), g)
    with pytest.raises(ValueError, match="backend must be 'auto', 'cpu', 'cuda' or 'reference'"): graph_loss(lp, torch.tensor([5, 5]), g, backend='gpu')
    with pytest.raises(ValueError, match='other must have'): GraphLattice(lp, torch.tensor([5, 5]), g).kl(GraphLattice(lp[:4], torch.tensor([4, 4]), g))

@pytest.mark.parametrize('backend,T', [('cpu', 30), ('cuda', 6)])       # (cuda: the emulator, on few frames)
def test_a_ctc_crf_as_a_graph_equals_sparse_logZ(backend, T):
    "A CTC-CRF as a graph (an epsilon arc from the start into each of 16 states) = sparse.logZ, and its gradient."
    from seqdist import sparse
    from seqdist.crf import kmer_transitions
    from seqdist.graph import sparse_crf_graph
    gen = torch.Generator().manual_seed(2)
    idx = kmer_transitions(2, 4)
    N, C, NZ = 5 if backend == 'cpu' else 3, *idx.shape        # (cpu: one bundle of four lanes and one sequence alone)
    Ms = torch.randn(T, N, C, NZ, generator=gen, dtype=torch.float64, requires_grad=True)
    v0, vT = torch.randn(C, generator=gen, dtype=torch.float64), torch.randn(C, generator=gen, dtype=torch.float64)
    want = sparse.logZ(Ms, idx, v0.expand(N, C), vT.expand(N, C))
    g_want, = torch.autograd.grad(want.sum(), Ms)
    got = graph_logz(Ms.flatten(2), torch.full((N,), T), sparse_crf_graph(idx, v0, vT), backend=backend)
    g_got, = torch.autograd.grad(got.sum(), Ms)
    assert torch.allclose(got, want, rtol=1e-12, atol=0) and torch.allclose(g_got, g_want, rtol=0, atol=1e-10)

def test_a_wide_dynamic_range_goes_to_log_space():
    "Emissions 1,000 nats apart (past the scaled kernel's range) give the reference's log Z and gradient."
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 4, 5, generator=gen, dtype=torch.float64) * 400
    graphs = ctc_graph(torch.randint(1, 5, (4, 3), generator=gen), torch.tensor([3, 2, 1, 3]))
    out = []
    for backend in ('cpu', 'reference'):
        xs = x.clone().requires_grad_()
        z = graph_logz(xs, torch.full((4,), 12), graphs, backend=backend)
        z.sum().backward()
        out.append((z.detach(), xs.grad))
    assert torch.allclose(out[0][0], out[1][0], rtol=1e-12) and torch.allclose(out[0][1], out[1][1], rtol=0, atol=1e-10)

def test_hub_states_past_the_tables():
    "A state entered (and one left) by many arcs: the scaled kernel's tables hold D arcs a state, the rest go to a list."
    gen = torch.Generator().manual_seed(0)
    S, C = 30, 6
    src = torch.cat([torch.zeros(5, dtype=torch.long), torch.randint(0, S, (75,), generator=gen)])
    dst = torch.cat([torch.zeros(60, dtype=torch.long), torch.randint(0, S, (20,), generator=gen)])
    g = Graph(src, dst, torch.randint(0, C, (80,), generator=gen), torch.randn(80, generator=gen, dtype=torch.float64),
              finals=torch.arange(S), num_states=S)
    assert len(g.topology.rest_in) > 0 and len(g.topology.rest_out) > 0
    x = torch.randn(15, 3, C, generator=gen, dtype=torch.float64)
    out = []
    for backend in ('cpu', 'reference'):
        xs, w = x.clone().requires_grad_(), g.scores.clone().requires_grad_()
        z = graph_logz(xs, torch.tensor([15, 10, 3]), Graph(g.src, g.dst, g.labels, w, g.start, g.finals, num_states=S), backend=backend)
        z.sum().backward()
        out.append((z.detach(), xs.grad, w.grad))
    for a, b in zip(*out): assert torch.allclose(a, b, rtol=0, atol=1e-10)

@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_lanes_of_a_shared_graph_equal_the_reference(dtype, tol):
    """Sequences sharing a graph and a length go four lanes at a time (hub states past the tables, epsilon arcs);
    a bundle with a lane out of the scaled range (one emission 400 nats below its frame's best) and the sequences
    left over go alone; frames past a sequence's length get gradient 0 in a buffer that held other values."""
    gen = torch.Generator().manual_seed(3)
    S, C = 12, 5
    src = torch.cat([torch.zeros(20, dtype=torch.long), torch.randint(0, S, (30,), generator=gen)])
    dst = torch.cat([torch.randint(0, S, (30,), generator=gen), torch.zeros(20, dtype=torch.long)])
    lab = torch.randint(0, C, (50,), generator=gen)
    lab[(src > dst) & (dst > 0)] = -1                     # (epsilon arcs, acyclic: towards lower states only)
    g = Graph(src, dst, lab, torch.randn(50, generator=gen, dtype=torch.float64), finals=torch.arange(S), num_states=S)
    assert len(g.topology.rest_in) and len(g.topology.rest_out) and len(g.topology.eps_arcs)
    lengths = torch.tensor([15] * 5 + [9] * 4 + [3, 0])
    x = torch.randn(15, 11, C, generator=gen, dtype=torch.float64)
    x[4, 6, 2] = -400.0
    bundles = G.lane_bundles(torch.zeros(11, dtype=torch.long).numpy(), lengths.numpy(), np.ones(1, np.bool_), np.array([S]))
    assert sorted(bundles.tolist()) == [[0, 1, 2, 3], [5, 6, 7, 8]]
    out = []
    for backend, xd in (('cpu', dtype), ('reference', torch.float64)):
        w = g.scores.clone().requires_grad_()
        for _ in range(2):                                # (the second call's posterior buffer held the first's)
            xs = x.to(xd).requires_grad_()
            z = graph_logz(xs, lengths, Graph(g.src, g.dst, g.labels, w, g.start, g.finals, num_states=S), backend=backend)
            gx, gw = torch.autograd.grad(z.sum(), (xs, w))
        out.append((z.double(), gx.double(), gw))
    for a, b in zip(*out): assert torch.allclose(a, b, rtol=0, atol=tol * max(1.0, float(b.detach().abs().max())))
    assert (out[0][1][torch.arange(15)[:, None] >= lengths[None]] == 0).all()

@pytest.mark.parametrize("backend", ['cpu', 'reference'])
def test_topk_equals_enumeration_and_its_scores_mark_their_paths(backend):
    gen = torch.Generator().manual_seed(11)
    for _ in range(12):
        g = small(gen, max_states=5)
        T = int(torch.randint(1, 5, (1,), generator=gen))
        lp = torch.randn(T, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
        best, scores = GraphLattice(lp, torch.tensor([T, T - 1]), g, backend=backend).topk(4)
        for b in range(2):
            paths, s = brute(g, lp.detach()[:T - b, b])
            want = s.sort(descending=True).values[:4]
            got = scores[:len(want), b]
            assert torch.allclose(got.detach(), want, rtol=0, atol=1e-10) and (scores[len(want):, b] == -math.inf).all()
            if len(want) and T - b > 0:                    # (a path of no frame reads no emission)
                grad, = torch.autograd.grad(scores[0, b], lp, retain_graph=True)
                arcs = best[0, b][best[0, b] >= 0]
                emitting = g.labels[arcs][g.labels[arcs] >= 0]
                assert torch.equal(grad[:, b].nonzero()[:, 1], emitting) and grad.sum() == len(emitting)

def _topk_case(gen, trial, N=3):
    "A ragged batch for topk: shared or per-sequence random graphs, with or without epsilon arcs, ties (rounded emissions)."
    shared = trial % 2 == 0
    gs = [small(gen, eps=0.4 if trial % 3 else 0.0, max_states=7, max_arcs=14) for _ in range(1 if shared else N)]
    T = int(torch.randint(0, 7, (1,), generator=gen))
    lengths = torch.randint(0, T + 1, (N,), generator=gen)
    lp = torch.randn(T, N, 3, generator=gen, dtype=torch.float64)
    return (lp.round() if trial % 4 == 0 else lp), lengths, gs[0] if shared else gs

@pytest.mark.parametrize("seed", range(2))
def test_topk_kernel_equals_the_reference_path_for_path(seed):
    """The CPU kernel's k best (`_graph_kbest_cpu`) are the reference's, path for path and in the same order (ties
    included: rounded emissions), also kept in segments of 1-3 frames; k past the number of paths, none at all; the
    scores within rounding."""
    gen, counts = torch.Generator().manual_seed(seed), [0, 0, 0, 0]
    for trial in range(60):
        lp, lengths, graphs = _topk_case(gen, trial)
        k = int(torch.randint(1, 9, (1,), generator=gen))
        want, want_scores = GraphLattice(lp, lengths, graphs, backend='reference').topk(k)
        lattice = GraphLattice(lp, lengths, graphs)
        got, scores = lattice.topk(k)
        assert torch.equal(got, want)
        assert torch.equal(scores == -math.inf, want_scores == -math.inf)
        assert torch.allclose(scores.nan_to_num(0.0, 0.0, 0.0), want_scores.nan_to_num(0.0, 0.0, 0.0), rtol=0, atol=1e-12)
        found = (want_scores > -math.inf).sum(0)
        for K in (1, 2, 3):
            paths, n_found = G._kbest_paths_cpu(lattice._state(lp), lattice.packed, k, K)
            assert torch.equal(paths, want) and torch.equal(n_found, found)
        counts[0] += int((found == 0).sum()); counts[1] += int(((found > 0) & (found < k)).sum()); counts[2] += int((found == k).sum())
        counts[3] += any(g.topology.n_eps for g in (graphs if isinstance(graphs, list) else [graphs]))
    assert min(counts) > 5, counts                        # (none, fewer than k, k, epsilon arcs: each case occurs)

def test_topk_kernel_scores_are_differentiable_as_the_reference():
    "The gradients of the kernel's path scores w.r.t. the emissions, arc and final scores: the reference's."
    gen, checked = torch.Generator().manual_seed(3), 0
    for trial in range(20):
        lp, lengths, graphs = _topk_case(gen, trial + 1)
        gs = graphs if isinstance(graphs, list) else [graphs]
        out = []
        for backend in ('cpu', 'reference'):
            x = lp.clone().requires_grad_()
            ws = [g.scores.clone().requires_grad_() for g in gs]
            fs = [g.final_scores.clone().requires_grad_() for g in gs]
            mine = [Graph(g.src, g.dst, g.labels, w, g.start, g.finals, f, num_states=g.num_states) for g, w, f in zip(gs, ws, fs)]
            paths, scores = GraphLattice(x, lengths, mine if isinstance(graphs, list) else mine[0], backend=backend).topk(3)
            total = (scores.nan_to_num(0.0, 0.0, 0.0) * torch.rand(scores.shape, generator=torch.Generator().manual_seed(trial), dtype=torch.float64)).sum()
            out.append(torch.autograd.grad(total, [x, *ws, *fs], allow_unused=True) if total.requires_grad else [None] * (1 + 2 * len(gs)))
        for a, b in zip(*out):
            a, b = (torch.zeros((), dtype=torch.float64) if t is None else t for t in (a, b))
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
            checked += bool(b.abs().sum() > 0)
    assert checked > 20

def test_topk_kernel_on_float32_emissions_and_long_sequences():
    """float32 emissions: the paths of their float64 values, as the reference reads them, on CTC graphs of 300 frames;
    an infeasible sequence (4 labels with a repeat in 4 frames) has none."""
    gen = torch.Generator().manual_seed(4)
    lp = torch.randn(300, 3, 6, generator=gen).log_softmax(-1)
    graphs = ctc_graph(torch.tensor([[1, 2, 2, 3], [4, 5, 0, 0], [1, 2, 2, 3]]), torch.tensor([4, 2, 4]))
    lengths = torch.tensor([300, 250, 4])
    got, scores = GraphLattice(lp, lengths, graphs).topk(5)
    want, want_scores = GraphLattice(lp, lengths, graphs, backend='reference').topk(5)
    assert torch.equal(got, want) and scores.dtype == torch.float32
    assert (scores[:, 2] == -math.inf).all() and (got[:, 2] == -1).all() and (scores[:, :2] > -math.inf).all()
    assert torch.allclose(scores[:, :2], want_scores[:, :2], rtol=1e-6, atol=0)

def test_only_graphs_of_at_most_lanes_max_states_go_four_lanes_at_a_time():
    "Four sequences of one graph and length: bundled while the graph is small, one a thread beyond LANES_MAX_STATES."
    seq_graph, lengths, ok = np.zeros(4, np.int64), np.full(4, 10), np.array([True])
    assert G.lane_bundles(seq_graph, lengths, ok, np.array([G.LANES_MAX_STATES])).tolist() == [[0, 1, 2, 3]]
    assert G.lane_bundles(seq_graph, lengths, ok, np.array([G.LANES_MAX_STATES + 1])).shape == (0, G.LANES)

def _scored(g, gen):
    "g with random arc and final scores (float64) that require a gradient."
    return Graph(g.src, g.dst, g.labels, torch.randn(g.num_arcs, generator=gen, dtype=torch.float64).requires_grad_(), g.start, g.finals,
                 torch.randn(len(g.finals), generator=gen, dtype=torch.float64).requires_grad_(), num_states=g.num_states)

@pytest.mark.parametrize('backend', ['auto', 'cuda'])
@pytest.mark.parametrize('shared', [True, False], ids=['one-graph', 'a-list'])
def test_torch_compile_fullgraph_gives_the_eager_result(backend, shared):
    """torch.compile(fullgraph=True) traces graph_loss whole (the graphs' structure packed as it traces, the kernel a
    custom op): the eager loss and its gradients w.r.t. the emissions, the arc and the final scores, exactly; one graph
    with epsilon arcs shared by the batch, or a list of CTC graphs, one of them twice; the CPU kernel, and the CUDA one
    through the emulator. Other graph objects are not read as the first (the structure, a constant, is guarded)."""
    gen = torch.Generator().manual_seed(6)
    lp = torch.randn(9, 3, 5, generator=gen, dtype=torch.float64).log_softmax(-1).requires_grad_()
    il = torch.tensor([9, 7, 6])
    if shared: graphs = distinct = _scored(compact_ctc_topology(5), gen)
    else:
        distinct = [_scored(g, gen) for g in ctc_graph(torch.tensor([[1, 2, 2], [4, 3, 0]]), torch.tensor([3, 2]))]
        graphs = [distinct[0], distinct[1], distinct[0]]
    leaves = [lp] + [x for g in (distinct if not shared else [distinct]) for x in (g.scores, g.final_scores)]
    def f(lp, graphs): return graph_loss(lp, il, graphs, reduction='sum', backend=backend) * 2.0
    compiled = torch.compile(f, fullgraph=True, backend='aot_eager')
    eager, comp = f(lp, graphs), compiled(lp, graphs)
    assert torch.isfinite(eager) and torch.equal(eager, comp)
    for a, b in zip(torch.autograd.grad(eager, leaves), torch.autograd.grad(comp, leaves)):
        assert a.abs().sum() > 0 and torch.equal(a, b)
    other = _scored(compact_ctc_topology(5), gen) if shared else graphs[1:] + graphs[:1]   # other graph objects: traced again
    assert torch.equal(compiled(lp, other), f(lp, other)) and not torch.equal(f(lp, other), eager)

def test_torch_compile_of_graphs_rebuilt_at_every_step_falls_back_to_the_eager_result():
    """Graphs made anew at every step (numerators from each batch's targets) are new constants: traced again per list,
    and past dynamo's recompile limit (without fullgraph) run eagerly; every step's loss and gradient are the eager ones."""
    gen = torch.Generator().manual_seed(8)
    lp = torch.randn(10, 3, 5, generator=gen, dtype=torch.float64).log_softmax(-1).requires_grad_()
    il = torch.tensor([10, 8, 7])
    def f(lp, graphs): return graph_loss(lp, il, graphs, reduction='sum')
    compiled = torch.compile(f, backend='aot_eager')
    from torch._dynamo import config
    with config.patch(recompile_limit=2):
        for step in range(5):
            graphs = ctc_graph(torch.randint(1, 5, (3, 3), generator=gen), torch.randint(1, 4, (3,), generator=gen))
            eager, comp = f(lp, graphs), compiled(lp, graphs)
            assert torch.equal(eager, comp), step
            assert torch.equal(torch.autograd.grad(eager, lp)[0], torch.autograd.grad(comp, lp)[0]), step

def test_torch_compile_fullgraph_of_graphs_packed_outside_serves_every_step():
    """Graphs made anew at every step, packed outside the compiled function (`pack_graphs`) and passed packed: their
    structure is an input (tensors, sizes and the SymInt most arcs and states made dynamic), so fullgraph=True compiles
    a few times at first and then serves every step, where the graphs themselves would need a compilation per list;
    each step's loss and gradients (emissions; the graphs' learnable scores) are the eager ones, graph_loss and mmi_loss."""
    from torch._dynamo.testing import CompileCounterWithBackend
    gen = torch.Generator().manual_seed(8)
    lp = torch.randn(12, 3, 5, generator=gen, dtype=torch.float64).log_softmax(-1).requires_grad_()
    il = torch.tensor([12, 8, 7])
    den = _scored(compact_ctc_topology(5), gen)
    def f(lp, packed): return graph_loss(lp, il, packed, reduction='sum') + G.mmi_loss(lp, il, packed, den, reduction='sum')
    counter = CompileCounterWithBackend('aot_eager')
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    for step in range(12):
        graphs = [_scored(g, gen) for g in ctc_graph(torch.randint(1, 5, (3, 4), generator=gen), torch.randint(1, 5, (3,), generator=gen))]
        packed = G.pack_graphs(graphs, 3)
        leaves = [lp, den.scores] + [g.scores for g in graphs]
        eager, comp = f(lp, packed), compiled(lp, packed)
        assert torch.isfinite(eager) and torch.equal(eager, comp), step
        for a, b in zip(torch.autograd.grad(eager, leaves), torch.autograd.grad(comp, leaves)): assert torch.equal(a, b), step
    assert counter.frame_count <= 3
    with pytest.raises(ValueError, match='packed for N = 2 sequences, got 3'): graph_loss(lp[:, :2], il[:2], packed)

def test_a_batchs_graphs_are_packed_once_across_calls(monkeypatch):
    """The structure of a list of graph objects (or of one shared graph) is packed on its first call and read from a cache
    after (a new list of the same objects too), kept while its graphs live; the scores are gathered at every call."""
    gen = torch.Generator().manual_seed(7)
    g, h = _scored(compact_ctc_topology(4), gen), _scored(ctc_topology(4), gen)
    first = G.pack_graphs(g, 3)
    again = G.pack_graphs(g, 3)
    assert again.layout is first.layout and again.seq_graph is first.seq_graph
    assert G.pack_graphs([g, h, g], 3).layout is G.pack_graphs([g, h, g], 3).layout is not first.layout
    packed = []
    pack = G._pack_layout
    monkeypatch.setattr(G, '_pack_layout', lambda gs: packed.append(len(gs)) or pack(gs))
    lp, il = torch.randn(6, 3, 4, generator=gen, dtype=torch.float64).log_softmax(-1), torch.tensor([6, 5, 4])
    k = _scored(compact_ctc_topology(4), gen)
    losses = [graph_loss(lp, il, k) for _ in range(3)] + [graph_loss(lp, il, [k, g, k]) for _ in range(3)]
    assert packed == [1, 2] and all(torch.equal(x, losses[0]) for x in losses[:3])
    with torch.no_grad(): k.final_scores += 1.0                   # scores are read at every call: each path ends once
    assert torch.allclose(graph_loss(lp, il, k), losses[0] - 1.0, rtol=0, atol=1e-12)
    entries = len(G._PACKED)
    del k, losses
    import gc; gc.collect()
    assert len(G._PACKED) == entries - 2                     # (its two entries went with it)
    with pytest.raises(ValueError, match=r"max_arcs and max_states must be the layout's most arcs and states of a graph \(10, 4\), got \(3, 4\)"):
        G.graph_logz_op(lp, il, first.arc_scores, first.final_scores, first.layout, first.seq_graph, 3, 4, 'Log', False)
