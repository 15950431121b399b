"""The losses on the graph lattice (seqdist.graph): MMI with a bigram CTC denominator, OTC's star and bypass arcs."""
import math
import pytest
import torch
from seqdist.graph import (Graph, graph_logz, graph_loss, ctc_graph, compose_labels, ctc_topology, mmi_loss, ctc_bigram_topology,
                           token_bigram, otc_graph, with_star, enumerate_paths, path_score)

def test_bigram_topology_adds_the_transcript_bigram_to_ctc():
    gen = torch.Generator().manual_seed(0)
    C = 6
    bigram = torch.randn(C, C, generator=gen, dtype=torch.float64).log_softmax(-1)
    den = ctc_bigram_topology(bigram)
    lp = torch.randn(15, 1, C, generator=gen, dtype=torch.float64).log_softmax(-1)
    for y in ([1, 2, 3], [2, 2], [5], [], [1, 1, 1, 2]):
        y = torch.tensor(y, dtype=torch.int64)
        prev = torch.cat([torch.tensor([0]), y[:-1]])
        gained = graph_logz(lp, torch.tensor([15]), compose_labels(den, y)) - graph_logz(lp, torch.tensor([15]), ctc_graph(y))
        assert abs(float(gained) - float(bigram[prev, y].sum())) < 1e-10
    # with a zero bigram, the denominator's paths are every CTC alignment of every label sequence: log Z = sum over
    # sequences of CTC's, which enumeration of the frame labels (each path reads one label a frame) gives as 0 here
    flat = ctc_bigram_topology(torch.zeros(C, C, dtype=torch.float64))
    z = graph_logz(lp[:4], torch.tensor([4]), flat)
    assert abs(float(z)) < 1e-10          # every label sequence of 4 frames is one path: sum of their probabilities is 1

def test_token_bigram_counts():
    B = token_bigram([[1, 2], [1, 3]], 4, add=0.0)
    assert torch.allclose(B[0, 1].exp(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(B[1, 2].exp(), torch.tensor(0.5, dtype=torch.float64)) and B[1, 0] == -math.inf

def test_mmi_loss_is_numerator_minus_denominator_and_differentiable():
    gen = torch.Generator().manual_seed(1)
    C, T, N = 5, 12, 3
    den = ctc_bigram_topology(token_bigram([[1, 2, 3], [4, 1]], C))
    ys = [torch.tensor([1, 2]), torch.tensor([4]), torch.tensor([3, 3])]
    nums = [compose_labels(den, y) for y in ys]
    x = torch.randn(T, N, C, generator=gen, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([12, 10, 12])
    loss = mmi_loss(x.log_softmax(-1), lengths, nums, den, reduction='none')
    want = -(graph_logz(x.log_softmax(-1), lengths, nums) - graph_logz(x.log_softmax(-1), lengths, den))
    assert torch.allclose(loss, want) and (loss >= -1e-12).all()        # the numerator's paths are the denominator's
    assert torch.autograd.gradcheck(lambda x: mmi_loss(x.log_softmax(-1), lengths, nums, den), (x,))
    short = mmi_loss(x.log_softmax(-1), torch.tensor([1, 1, 1]), nums, den, reduction='none')
    assert short[0] == math.inf and mmi_loss(x.log_softmax(-1), torch.tensor([1, 1, 1]), nums, den, zero_infinity=True, reduction='none')[0] == 0
    f = lambda x: mmi_loss(x.log_softmax(-1), lengths, nums, den)       # torch.compile traces it whole: the eager result
    eager, comp = f(x), torch.compile(f, fullgraph=True, backend='aot_eager')(x)
    assert torch.equal(eager, comp) and torch.equal(torch.autograd.grad(eager, x)[0], torch.autograd.grad(comp, x)[0])

def test_otc_at_closed_penalties_is_ctc_and_its_arcs_are_counted():
    gen = torch.Generator().manual_seed(2)
    C = 5
    lp = torch.randn(8, 2, C, generator=gen, dtype=torch.float64).log_softmax(-1)
    ys, lengths = torch.tensor([[1, 2], [3, 0]]), torch.tensor([2, 1])
    closed = otc_graph(ys, lengths, star=C, star_penalty=-math.inf, bypass_penalty=-math.inf)
    assert torch.allclose(graph_logz(with_star(lp), torch.tensor([8, 8]), closed), graph_logz(lp, torch.tensor([8, 8]), ctc_graph(ys, lengths)))
    # enumeration: each path pays the star penalty per star loop and the bypass penalty per bypass it takes
    g = otc_graph(torch.tensor([1, 2]), star=C, star_penalty=-0.7, bypass_penalty=-1.3)
    x = with_star(lp[:5, 0])
    paths = enumerate_paths(g, 5)
    S = g.num_states
    n_base = len(g.labels) - S - 3                       # ctc_graph's arcs, then S star loops, then 3 bypasses (L = 2)
    for arcs, f in paths[:50]:
        loops = sum(n_base <= a < n_base + S for a in arcs)
        bypasses = sum(a >= n_base + S for a in arcs)
        base = sum(float(x[t, g.labels[a]]) for t, a in enumerate(arcs))
        assert abs(float(path_score(g, x, arcs, f)) - (base - 0.7 * loops - 1.3 * bypasses)) < 1e-6     # (float32 scores)
    z = torch.stack([path_score(g, x, a, f) for a, f in paths]).logsumexp(0)
    assert torch.allclose(graph_logz(x[:, None], torch.tensor([5]), g)[0], z)
    assert sum(1 for a, f in paths if all(int(g.labels[b]) == C for b in a)) > 0      # both labels bypassed: star frames only

def test_with_star_and_bad_calls():
    lp = torch.randn(3, 1, 4).log_softmax(-1)
    s = with_star(lp)
    assert s.shape == (3, 1, 5) and torch.allclose(s[..., 4], (lp[..., 1:].exp().mean(-1)).log())
    with pytest.raises(ValueError, match='star'): otc_graph(torch.tensor([1]), star=None)
    with pytest.raises(ValueError, match='log_bigram'): ctc_bigram_topology(torch.zeros(3, 4))
    with pytest.raises(ValueError, match='reduction'): mmi_loss(lp, torch.tensor([3]), ctc_graph(torch.tensor([1])), ctc_topology(4), reduction='avg')
