"""The graph lattice's CUDA kernel (`graph_logz(..., backend='cuda')`), through the emulator on CPU tensors: log Z and
its gradients w.r.t. the emissions, arc and final scores equal the CPU kernel's and the reference's on random graphs
with epsilon arcs, ragged batches, infeasible sequences, CTC graphs (= F.ctc_loss), the Max semiring (its gradient the
best path), the looping path (more states than threads), repeatability and one launch a step; GraphLattice's questions
on the CUDA path (the posteriors' from the kernel, the walks' on the CPU kernels) = the CPU path's, emulated here and on
CUDA tensors under `make gpu-check`; run as on a GPU, a warm call reads nothing back from the device and copies nothing
to it, and checks its lengths there."""
import math, sys
import pytest
import torch
import torch.nn.functional as F
import seqdist.graph as G
from seqdist.graph import Graph, graph_logz, graph_loss, random_graph, ctc_graph
from seqdist.ops import launch_limits
from seqdist.kernel import count_launches

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=1e-5, atol=1e-5)}

def _batch(seed, dtype, N=4, T=9, C=5):
    "Random graphs with epsilon arcs (three, shared by a batch of N), emissions and uneven lengths (one 0)."
    g = torch.Generator().manual_seed(seed)
    gs = [random_graph(int(torch.randint(2, 11, (), generator=g)), int(torch.randint(3, 22, (), generator=g)), C, generator=g)
          for _ in range(3)]
    lp = torch.randn(T, N, C, generator=g, dtype=torch.float64).mul(2).log_softmax(-1).to(dtype)
    lengths = torch.randint(0, T + 1, (N,), generator=g)
    lengths[seed % N] = 0
    return lp, lengths, gs, [seed % 3, 0, 1, 2][:N]

def _grads(lp, lengths, gs, which, semiring, backend):
    "log Z and its gradients (of the feasible sequences' sum) w.r.t. log_probs, each graph's arc and final scores."
    x = lp.clone().requires_grad_()
    ws = [g.scores.clone().requires_grad_() for g in gs]
    fs = [g.final_scores.clone().requires_grad_() for g in gs]
    gg = [Graph(g.src, g.dst, g.labels, w, g.start, g.finals, f, num_states=g.num_states) for g, w, f in zip(gs, ws, fs)]
    z = graph_logz(x, lengths, [gg[i] for i in which], semiring=semiring, backend=backend)
    grads = torch.autograd.grad(torch.where(torch.isfinite(z), z, 0).sum(), [x, *ws, *fs], allow_unused=True)
    return z.detach(), [torch.zeros_like(t) if d is None else d for d, t in zip(grads, [x, *ws, *fs])]

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_the_emulated_kernel_equals_the_cpu_kernel_and_the_reference(dtype):
    for seed in range(4):
        lp, lengths, gs, which = _batch(seed, dtype)
        z, grads = _grads(lp, lengths, gs, which, 'Log', 'cuda')
        z_cpu, grads_cpu = _grads(lp, lengths, gs, which, 'Log', 'cpu')
        z_ref = graph_logz(lp, lengths, [gs[i] for i in which], backend='reference')
        assert z.dtype == dtype and not z.isnan().any()
        torch.testing.assert_close(z, z_cpu, **TOL[dtype])
        torch.testing.assert_close(z, z_ref, **TOL[dtype])
        for a, b in zip(grads, grads_cpu): torch.testing.assert_close(a, b, **TOL[dtype])

def test_max_semiring_its_value_and_its_gradient_the_best_path():
    for seed in range(4):
        lp, lengths, gs, which = _batch(seed, torch.float64)
        z, grads = _grads(lp, lengths, gs, which, 'Max', 'cuda')
        z_cpu, grads_cpu = _grads(lp, lengths, gs, which, 'Max', 'cpu')
        assert torch.equal(z, z_cpu)
        for a, b in zip(grads, grads_cpu): assert torch.equal(a, b)
        torch.testing.assert_close(z, graph_logz(lp, lengths, [gs[i] for i in which], semiring='Max', backend='reference'), **TOL[z.dtype])

def test_infeasible_sequences_give_minus_inf_and_zero_gradients():
    g = ctc_graph(torch.tensor([1, 1, 2]))                  # needs 4 frames (a blank between the repeats)
    lp = torch.randn(5, 3, 3, dtype=torch.float64).log_softmax(-1).requires_grad_()
    lengths = torch.tensor([3, 5, 0])
    for dtype in (torch.float64, torch.float32):
        x = lp.detach().to(dtype).requires_grad_()
        z = graph_logz(x, lengths, g, backend='cuda')
        assert torch.isneginf(z[[0, 2]]).all() and torch.isfinite(z[1])
        torch.testing.assert_close(z, graph_logz(x.detach(), lengths, g, backend='cpu'), **TOL[dtype])
        loss = graph_loss(x, lengths, g, reduction='sum', zero_infinity=True, backend='cuda')
        grad, = torch.autograd.grad(loss, x)
        assert not grad.isnan().any() and (grad[:, [0, 2]] == 0).all()
        torch.testing.assert_close(grad[:, 1].sum(-1), -torch.ones(5, dtype=dtype), **TOL[dtype])   # one label a frame

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_ctc_graphs_equal_ctc_loss(dtype):
    g = torch.Generator().manual_seed(3)
    T, N, C = 10, 4, 5
    x = torch.randn(T, N, C, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    lp = x.log_softmax(-1)                  # (F.ctc_loss's gradient is that of log_softmax'd inputs: compare w.r.t. x)
    targets = torch.randint(1, C, (N, 4), generator=g)
    targets[0, 1] = targets[0, 0]                                       # a repeat
    tl, il = torch.tensor([4, 2, 0, 3]), torch.tensor([10, 7, 3, 9])
    ours = graph_loss(lp, il, ctc_graph(targets, tl), reduction='none', backend='cuda')
    theirs = F.ctc_loss(lp, targets, il, tl, reduction='none')
    torch.testing.assert_close(ours, theirs, **TOL[dtype])
    g1, = torch.autograd.grad(ours.sum(), x, retain_graph=True)
    g2, = torch.autograd.grad(theirs.sum(), x)
    torch.testing.assert_close(g1, g2, **TOL[dtype])

def test_more_states_than_threads_gives_the_same_bits_and_runs_again_the_same():
    lp, lengths, gs, which = _batch(7, torch.float64, T=6)
    gs = [random_graph(10, 20, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    z, grads = _grads(lp, lengths, gs, which, 'Log', 'cuda')
    with launch_limits(max_threads=3):                        # (10 states, 3 threads: the strided loops)
        z3, grads3 = _grads(lp, lengths, gs, which, 'Log', 'cuda')
    z_again, grads_again = _grads(lp, lengths, gs, which, 'Log', 'cuda')
    for a, b, c in zip([z, *grads], [z3, *grads3], [z_again, *grads_again]):
        assert torch.equal(a, b) and torch.equal(a, c)

def test_one_launch_for_a_forward_and_backward():
    lp, lengths, gs, which = _batch(1, torch.float64, T=4)
    x = lp.clone().requires_grad_()
    with count_launches() as n:
        graph_loss(x, lengths, [gs[i] for i in which], backend='cuda').backward()
    assert dict(n) == {'graph_logz': 1}

def test_backends_are_named():
    lp = torch.randn(5, 2, 3).log_softmax(-1)
    with pytest.raises(ValueError, match="backend must be 'auto', 'cpu', 'cuda' or 'reference'"):
        graph_logz(lp, torch.tensor([5, 5]), ctc_graph(torch.tensor([1, 2])), backend='gpu')

def test_graph_lattice_log_partition_through_the_kernel():
    from seqdist.graph import GraphLattice
    lp, lengths, gs, which = _batch(2, torch.float64, T=5)
    graphs = [gs[i] for i in which]
    got = GraphLattice(lp, lengths, graphs, backend='cuda').log_partition
    torch.testing.assert_close(got, GraphLattice(lp, lengths, graphs, backend='cpu').log_partition, **TOL[torch.float64])

def test_nan_in_nan_out_and_half_precision_inputs():
    lp = torch.randn(6, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    lp[2, 1, 3] = math.nan
    gs = ctc_graph(torch.tensor([[1, 2], [2, 3], [3, 3]]), torch.tensor([2, 2, 2]))
    out = {}
    for backend in ('cpu', 'cuda'):
        x = lp.clone().requires_grad_()
        loss = graph_loss(x, torch.tensor([6, 6, 6]), gs, reduction='none', backend=backend)
        out[backend] = loss.detach(), torch.autograd.grad(loss.sum(), x)[0]
    torch.testing.assert_close(out['cuda'], out['cpu'], equal_nan=True, **TOL[torch.float64])
    assert out['cuda'][0].isnan().tolist() == [False, True, False]
    x = lp.nan_to_num().half().requires_grad_()                    # fp16: computed in float32, the gradient in fp16
    loss = graph_loss(x, torch.tensor([6, 6, 6]), gs, reduction='sum', backend='cuda')
    grad, = torch.autograd.grad(loss, x)
    assert grad.dtype == torch.float16
    torch.testing.assert_close(loss, graph_loss(x.detach().float(), torch.tensor([6, 6, 6]), gs, reduction='sum', backend='cpu'), **TOL[torch.float32])

def test_epsilon_arcs_by_levels_a_deep_chain():
    """A chain of epsilon arcs 4 deep with arcs into one state from several levels = the CPU kernel, the same bits on
    1 thread as on 32 (a CTC-CRF's graph, an epsilon level of 16 arcs: tests/test_graph.py, against sparse.logZ)."""
    gen = torch.Generator().manual_seed(2)
    # states 0 -eps-> 1 -eps-> 2 -eps-> 3 -eps-> 4, shortcuts 0 -> 2 and 1 -> 4 (eps), emitting arcs around
    g = Graph.from_arcs([(0, 1, -1, 0.3), (1, 2, -1, -0.2), (2, 3, -1, 0.5), (3, 4, -1, 0.1), (0, 2, -1, -0.7), (1, 4, -1, 0.2),
                         (4, 0, 1, 0.0), (2, 2, 0, -0.1), (3, 1, 2, 0.4), (4, 4, 1, 0.2), (0, 3, 0, -0.3)], start=0, finals=[2, 4],
                        final_scores=[0.1, -0.2])
    lp = torch.randn(5, 3, 3, generator=gen, dtype=torch.float64).log_softmax(-1)
    lengths = torch.tensor([5, 2, 0])
    ws = {}
    for backend, limit in (('cpu', None), ('cuda', None), ('cuda', 1)):
        x = lp.clone().requires_grad_()
        w = g.scores.clone().requires_grad_()
        gg = Graph(g.src, g.dst, g.labels, w, g.start, g.finals, g.final_scores)
        with launch_limits(max_threads=limit):
            z = graph_logz(x, lengths, gg, backend=backend)
            ws[backend, limit] = [z.detach(), *torch.autograd.grad(z.sum(), [x, w])]
    for a, b, c in zip(ws['cuda', None], ws['cuda', 1], ws['cpu', None]):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, **TOL[torch.float64])

def _ragged(seed, dtype, shared, N=5, T=11, C=4):
    """Random graphs with epsilon arcs, one shared by the batch or one a sequence, and lengths 0, T, one past a
    multiple of 2, 3 and 5 (a last segment of one frame) and one random."""
    g = torch.Generator().manual_seed(seed)
    gs = [random_graph(int(torch.randint(2, 9, (), generator=g)), int(torch.randint(4, 20, (), generator=g)), C, 0.4, g)
          for _ in range(1 if shared else N)]
    lp = torch.randn(T, N, C, generator=g, dtype=torch.float64).mul(2).log_softmax(-1).to(dtype)
    lengths = torch.tensor([0, T, 7, 6, int(torch.randint(1, T + 1, (), generator=g))])
    return lp, lengths, gs, [0] * N if shared else list(range(N))

@pytest.mark.parametrize('semiring', ['Log', 'Max'])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_checkpointed_forward_scores_give_the_kept_ones_bits(monkeypatch, semiring, dtype):
    """Past CUDA_FORWARD_BYTES the kernel keeps every K-th frame's forward scores and recomputes a segment at a time
    in the backward (posteriors, the best-path walk): the same bits as keeping every frame (the rows are the same sums
    in the same order), and so the CPU kernel's values (Max in float64: its bits), for segments of 2, 3, 5 frames, one segment
    (11) and one longer than the input (16), shared and per-sequence graphs, 32 threads and 3 (strided, and the
    threads that do not walk the best path help recompute)."""
    for seed, shared in ((0, True), (0, False), (3, True), (2, False)):
        lp, lengths, gs, which = _ragged(seed, dtype, shared)
        kept, grads_kept = _grads(lp, lengths, gs, which, semiring, 'cuda')
        z_cpu, grads_cpu = _grads(lp, lengths, gs, which, semiring, 'cpu')
        assert torch.isfinite(kept).sum() >= 3            # (feasible sequences to differentiate)
        for K, threads in ((2, None), (3, 3), (5, None), (11, 3), (16, None)):
            monkeypatch.setattr(G, 'cuda_segment_frames', lambda *_: K)
            with launch_limits(max_threads=threads):
                z, grads = _grads(lp, lengths, gs, which, semiring, 'cuda')
            assert all(torch.equal(a, b) for a, b in zip([z, *grads], [kept, *grads_kept])), (seed, K, threads)
            for a, b in zip([z, *grads], [z_cpu, *grads_cpu]):
                if semiring == 'Max' and dtype == torch.float64: assert torch.equal(a, b)
                else: torch.testing.assert_close(a, b, **TOL[dtype])        # (the CPU kernel sums in float64)

def test_the_budget_keeps_every_sqrt_t_th_frame_and_allocates_that_much(monkeypatch):
    """Within CUDA_FORWARD_BYTES every frame is kept, past it (N, T // K + 1, S) checkpoints and (N, K - 1, S) of scratch
    with K = isqrt(T) + 1 (the issue's shared 20,000 states, N = 32, T = 500, float32: 44 rows instead of 501); the
    forward alone keeps two rows. The launches' buffers are those, one launch a step, and the results the CPU kernel's."""
    assert G.cuda_segment_frames(500, 32, 2_000, 4) == 1                   # 128 MB: every frame
    assert G.cuda_segment_frames(500, 32, 20_000, 4) == 23                 # 1.28 GB: 21 + 1 checkpoints, 22 rows scratch
    shapes = []
    kernel = G._graph_kernels[(torch.float64, 'Log', False)]
    def recording(grid, block, *, alpha, seg, **named):
        shapes.append((tuple(alpha.shape), tuple(seg.shape)))
        return kernel(grid, block, alpha=alpha, seg=seg, **named)
    monkeypatch.setitem(G._graph_kernels, (torch.float64, 'Log', False), recording)
    lp, lengths, gs, which = _ragged(4, torch.float64, shared=True)          # T = 11, N = 5
    S = gs[0].num_states
    for budget, K in ((G.CUDA_FORWARD_BYTES, 1), (5 * 12 * S * 8, 1), (5 * 12 * S * 8 - 1, 4), (0, 4)):
        monkeypatch.setattr(G, 'CUDA_FORWARD_BYTES', budget)
        shapes.clear()
        with count_launches() as launches: z, grads = _grads(lp, lengths, gs, which, 'Log', 'cuda')
        assert dict(launches) == {'graph_logz': 1}                           # (the segments: a loop in the kernel)
        assert shapes == [((5, 11 // K + 1, S), (5, K - 1, S))], (budget, shapes)
        z_cpu, grads_cpu = _grads(lp, lengths, gs, which, 'Log', 'cpu')
        for a, b in zip([z, *grads], [z_cpu, *grads_cpu]): torch.testing.assert_close(a, b, **TOL[torch.float64])
        shapes.clear()
        graph_logz(lp, lengths, [gs[i] for i in which], backend='cuda')
        assert shapes == [((5, 2, S), (5, 0, S))]

# GraphLattice's questions on the CUDA path: log Z, the posteriors, the expectations, the best path and the samples from
# the CUDA kernel (one launch a lattice), the k best on the CPU kernel from one host copy of the emissions.
LATTICE_TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9),
               # float32: the CUDA kernel sums in float32, the CPU kernel in float64; an expectation (entropy, cross
               # entropy, KL) adds T C posteriors (each within about 1e-6) times scores, log Z's of |50| or so
               torch.float32: dict(rtol=1e-4, atol=1e-4)}

def _lattice_case(seed, dtype, shared, N=5, T=9, C=4):
    """Emissions p and q (T, N, C), lengths 0, T, 7, 3 and random, and random graphs with epsilon arcs: one shared by
    the batch, or one a sequence (two sequences the same object). Sequence 3 is infeasible: shared, a frame that no
    label can take; per sequence, a CTC graph of 1 1 2 (4 frames at least) through its 3."""
    g = torch.Generator().manual_seed(seed)
    gs = [random_graph(int(torch.randint(2, 8, (), generator=g)), int(torch.randint(4, 16, (), generator=g)), C, 0.4, g)
          for _ in range(1 if shared else N)]
    lp, lq = torch.randn(2, T, N, C, generator=g, dtype=torch.float64).mul(2).log_softmax(-1).to(dtype)
    lengths = torch.tensor([0, T, 7, 3, int(torch.randint(1, T + 1, (), generator=g))])
    if shared: lp[1, 3] = -math.inf
    else: gs[3], gs[4] = ctc_graph(torch.tensor([1, 1, 2])), gs[2]
    return lp, lq, lengths, gs[0] if shared else gs

def _lattice_answers(p, q):
    """Every question of GraphLattice p (q: the other of cross_entropy and kl), and the kernel launches of each;
    log_prob of the samples and the k best, and the gradients of the k best's and log_prob's scores."""
    asks = dict(log_partition=lambda: p.log_partition, marginals=lambda: p.marginals, arc_marginals=lambda: p.arc_marginals,
                entropy=p.entropy, cross_entropy=lambda: p.cross_entropy(q), kl=lambda: p.kl(q), argmax=lambda: p.argmax,
                sample=lambda: p.sample((4,), generator=torch.Generator().manual_seed(1)), topk=lambda: p.topk(3))
    out, launches = {}, {}
    for name, ask in asks.items():
        with count_launches() as n: out[name] = ask()
        launches[name] = dict(n)
    out['log_prob'] = p.log_prob(torch.cat([out['sample'], out['topk'][0]]))
    x = p.log_probs
    for name, scores in (('topk_grad', out['topk'][1]), ('log_prob_grad', out['log_prob'])):
        if x.requires_grad: out[name], = torch.autograd.grad(torch.where(torch.isfinite(scores), scores, 0).sum(), x, retain_graph=True)
    return out, launches

def _assert_same_answers(got, want, dtype, device):
    "got's answers on `device` = want's (the CPU path's): paths exactly, values within LATTICE_TOL[dtype] (NaN alike)."
    assert got.keys() == want.keys()
    for name in want:
        for a, b in zip(*((x if isinstance(x, tuple) else (x,)) for x in (got[name], want[name]))):
            assert a.device.type == device and a.shape == b.shape and a.dtype == b.dtype, (name, a.device, a.shape, a.dtype)
            if a.is_floating_point(): torch.testing.assert_close(a.cpu(), b, equal_nan=True, **LATTICE_TOL[dtype], msg=lambda m: f"{name}: {m}")
            else: assert torch.equal(a.cpu(), b), name

def _no_reference(monkeypatch):
    "The per-sequence reference, refused (GraphLattice's questions on the kernels must not reach it)."
    def refused(*args, **kw): raise AssertionError("the reference ran")
    for name in ('graph_forward_reference', 'walk_back_reference', 'kbest_paths_reference', '_reference_logz'):
        monkeypatch.setattr(G, name, refused)

_LAUNCHES = dict(log_partition=1, marginals=1, arc_marginals=1, entropy=1, cross_entropy=2, kl=2, argmax=1, sample=1, topk=0)

@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'per-sequence'])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_graph_lattice_questions_through_the_emulated_kernel_equal_the_cpu_path(dtype, shared, monkeypatch):
    """backend='cuda' on CPU tensors (the emulator): log Z, the posteriors' questions, argmax and sample from the CUDA
    kernel, one launch a lattice (cross entropy and KL: p's forward and backward, q's forward), in the emissions'
    precision; topk on the CPU kernel, no launch; every answer the CPU path's (paths exactly), with lengths 0 and an infeasible sequence."""
    _no_reference(monkeypatch)
    for seed in (1, 9):                                   # (9: epsilon chains two deep)
        lp, lq, lengths, graphs = _lattice_case(seed, dtype, shared)
        runs = {}
        for backend in ('cuda', 'cpu'):
            x = lp.clone().requires_grad_()
            runs[backend] = _lattice_answers(G.GraphLattice(x, lengths, graphs, backend=backend), G.GraphLattice(lq, lengths, graphs, backend=backend))
        (got, launches), (want, _) = runs['cuda'], runs['cpu']
        z = want['log_partition']
        assert torch.isfinite(z).tolist() == [True, True, True, False, True]              # (length 0 too)
        assert launches == {k: {'graph_logz': n} if n else {} for k, n in _LAUNCHES.items()}
        assert torch.isneginf(got['log_prob'][:, 3]).all()                               # (no path: -inf, not NaN)
        _assert_same_answers(got, want, dtype, 'cpu')

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_argmax_through_the_emulated_kernel_with_checkpoints_gives_the_cpu_paths(dtype, monkeypatch):
    """GraphLattice.argmax with backend='cuda': the kernel's Max walk writes the path (the arcs first to last, -1 after
    them; all -1 where no path fits) in one launch, the CPU Viterbi kernel's paths exactly, also where the forward
    scores are kept every sqrt(T) frames and the walk recomputes a segment at a time (CUDA_FORWARD_BYTES 0)."""
    _no_reference(monkeypatch)
    for seed in (1, 9):                                   # (9: epsilon chains two deep)
        lp, _, lengths, graphs = _lattice_case(seed, dtype, shared=False)
        want = G.GraphLattice(lp, lengths, graphs, backend='cpu').argmax
        assert (want[3] == -1).all() and (want[0] >= 0).sum() <= 2           # (infeasible; length 0: epsilon arcs alone)
        for kept in (G.CUDA_FORWARD_BYTES, 0):
            monkeypatch.setattr(G, 'CUDA_FORWARD_BYTES', kept)
            assert G.cuda_segment_frames(9, 5, 8, 8) == (1 if kept else 4)
            with count_launches() as n: got = G.GraphLattice(lp, lengths, graphs, backend='cuda').argmax
            assert dict(n) == {'graph_logz': 1} and torch.equal(got, want), (seed, kept)

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_samples_through_the_emulated_kernel_with_checkpoints_and_more_draws_than_threads_give_the_cpu_paths(dtype, monkeypatch):
    """GraphLattice.sample with backend='cuda': the kernel's Log pass walks the draws back (a thread a draw, several a
    thread past the block's size) in one launch, and gives the CPU kernel's paths for the same generator's uniforms,
    also where the forward scores are kept every sqrt(T) frames (CUDA_FORWARD_BYTES 0); all -1 where no path fits."""
    _no_reference(monkeypatch)
    monkeypatch.setattr(G, 'GRAPH_THREADS', 32)                          # (300 draws: up to ten a thread)
    for seed in (1, 9):
        lp, _, lengths, graphs = _lattice_case(seed, dtype, shared=False)
        want = G.GraphLattice(lp, lengths, graphs, backend='cpu').sample((3, 100), generator=torch.Generator().manual_seed(seed))
        assert (want[:, :, 3] == -1).all() and len({tuple(x.tolist()) for x in want.flatten(0, 1).flatten(0, 1)}) > 5   # (varied)
        for kept in (G.CUDA_FORWARD_BYTES, 0):
            monkeypatch.setattr(G, 'CUDA_FORWARD_BYTES', kept)
            with count_launches() as n:
                got = G.GraphLattice(lp, lengths, graphs, backend='cuda').sample((3, 100), generator=torch.Generator().manual_seed(seed))
            assert dict(n) == {'graph_logz': 1} and torch.equal(got, want), (seed, kept)

def _graphs_on(graphs, device):
    "The graphs with their arc and final scores on `device` (one object for each distinct one)."
    moved = {}
    def on(g): return moved.setdefault(id(g), Graph(g.src, g.dst, g.labels, g.scores.to(device), g.start, g.finals,
                                                       g.final_scores.to(device), num_states=g.num_states))
    return on(graphs) if isinstance(graphs, Graph) else [on(g) for g in graphs]

@pytest.mark.gpu
@pytest.mark.parametrize('backend', ['auto', 'cuda'])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_gpu_graph_lattice_questions_on_cuda_tensors_equal_the_cpu_path(dtype, backend, monkeypatch, device='cuda'):
    """On CUDA tensors, backend 'auto' and 'cuda': every answer on the GPU and the CPU path's (paths exactly; the
    gradients of the k best's and log_prob's scores too), log Z, the posteriors' questions, argmax and sample by the CUDA
    kernel (one launch a lattice), topk by the CPU kernel on a host copy, never the reference; shared and per-sequence
    graphs, lengths 0 and an infeasible sequence; the graphs' scores and the lengths on the CPU ('auto') or the GPU."""
    _no_reference(monkeypatch)
    for seed, shared in ((1, True), (9, False), (9, True), (1, False)):
        lp, lq, lengths, graphs = _lattice_case(seed, dtype, shared)
        want, _ = _lattice_answers(G.GraphLattice(lp.clone().requires_grad_(), lengths, graphs, backend='cpu'),
                                   G.GraphLattice(lq, lengths, graphs, backend='cpu'))
        there = (graphs, lengths) if backend == 'auto' else (_graphs_on(graphs, device), lengths.to(device))
        got, launches = _lattice_answers(G.GraphLattice(lp.to(device).requires_grad_(), there[1], there[0], backend=backend),
                                         G.GraphLattice(lq.to(device), there[1], there[0], backend=backend))
        assert launches == {k: {'graph_logz': n} if n else {} for k, n in _LAUNCHES.items()}
        _assert_same_answers(got, want, dtype, device)

class _DeviceModel(torch.overrides.TorchFunctionMode):
    """What a call would wait for the GPU for, were the CUDA path's device tensors on one (here on the CPU, emulated):
    the tensors `on_device` (the call's inputs, the tables cached on the device) and every tensor a torch function makes
    from one, or with a `device=`, count as on the device; recorded are a host read of one (`item`, `bool`, `int`,
    `tolist`, `numpy`, ...), a copy of one to the host (`cpu()`, `.to('cpu')`), and a move of a host tensor to a device
    at the call (`.to(device)`, `copy_`, `torch.tensor(..., device=)`: pageable, it waits too). The emulator's launch is
    not watched (a GPU launches instead), and a `.to(d)` of a device tensor is taken to stay on the device unless d is
    spelled 'cpu' (the emulator's device is the CPU: the model cannot tell a device from the host otherwise)."""
    READS = {'item', '__bool__', '__int__', '__float__', '__index__', '__complex__', 'tolist', 'numpy', '__array__', '__format__', '__repr__'}

    def __init__(self, on_device):
        super().__init__()
        self.ids, self.keep, self.syncs, self.paused = set(), [], [], False
        self.mark(on_device)

    def mark(self, xs):
        "Count the tensors in xs (nested lists, tuples, dicts) as on the device."
        if isinstance(xs, torch.Tensor): self.ids.add(id(xs)); self.keep.append(xs)
        elif isinstance(xs, dict): self.mark(list(xs.values()))
        elif isinstance(xs, (list, tuple)):
            for x in xs: self.mark(x)

    def where(self):
        "The seqdist line that made the call."
        f = sys._getframe(2)
        while f is not None and '/seqdist/' not in f.f_code.co_filename.replace('\\', '/'): f = f.f_back
        return f"{f.f_code.co_name}:{f.f_lineno}" if f is not None else "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused: return out
        name = getattr(func, '__name__', str(func))
        tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        on = any(id(x) in self.ids for x in tensors)
        device = kwargs.get('device', next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        if on and (name in self.READS or name == 'cpu' or (name == 'to' and isinstance(device, str) and device.startswith('cpu'))):
            self.syncs.append(f"{name} of a device tensor ({self.where()})")
            return out
        if name == 'copy_' and len(args) > 1 and (id(args[0]) in self.ids) != (id(args[1]) in self.ids):
            self.syncs.append(f"copy_ between the host and the device ({self.where()})")
        elif not on and device is not None and name in ('to', 'cuda', 'tensor', 'as_tensor', 'from_numpy'):
            self.syncs.append(f"{name} of a host tensor to a device ({self.where()})")
        if on or device is not None: self.mark(out)
        return out

def _watched_device(monkeypatch, on_device):
    """A `_DeviceModel` of the tensors `on_device` and of those cached on the device by a warm call, with the emulator's
    launches unwatched (a GPU launches instead)."""
    import seqdist.kernel, seqdist.memory
    model = _DeviceModel([*on_device, *(v for _, _, entry in list(seqdist.memory._TENSOR_CACHE.values()) for v in entry.values())])
    launch = seqdist.kernel._launch_emulator
    def launch_unwatched(*args):
        model.paused = True
        try: return launch(*args)
        finally: model.paused = False
    monkeypatch.setattr(seqdist.kernel, '_launch_emulator', launch_unwatched)
    return model

def test_a_warm_cuda_call_reads_nothing_back_from_the_device(monkeypatch):
    """graph_loss's forward and backward with backend='cuda', its lengths and the graphs' scores on the device (as
    tests/test_gpu.py's graph case puts them), as a GPU would run them (`on_host` False: checks asserted on the device):
    once warm, no host read of a device value and no copy at the call (`_DeviceModel`); the CUDA kernel's tables and
    the batch's structure stay on the device between calls."""
    import seqdist.checks, seqdist.ops
    lp, lengths, gs, which = _batch(0, torch.float32, N=4)
    lengths[0] = 3                                                     # (no length 0: the CPU shortcut aside, the same)
    gs = [Graph(g.src, g.dst, g.labels, g.scores.clone().requires_grad_(), g.start, g.finals, g.final_scores.clone().requires_grad_(),
                num_states=g.num_states) for g in gs]                 # (learnable: their gradients' path watched too)
    graphs = [gs[i] for i in which]
    x = lp.clone().requires_grad_()
    def call():
        loss = graph_loss(x, lengths, graphs, reduction='sum', backend='cuda')
        return loss
    for module in (G, seqdist.checks): monkeypatch.setattr(module, 'on_host', lambda *xs: False, raising=False)
    call().backward()                                                  # warm: the kernel built, the structure packed
    model = _watched_device(monkeypatch, [x, lengths, *(t for g in gs for t in (g.scores, g.final_scores))])
    backward = seqdist.ops._Eager.backward
    def backward_watched(ctx, *grads):
        model.mark(grads)                                              # (autograd's, from the device's loss)
        with model: return backward(ctx, *grads)
    monkeypatch.setattr(seqdist.ops._Eager, 'backward', staticmethod(backward_watched))
    for t in (x, *(t for g in gs for t in (g.scores, g.final_scores))): t.grad = None
    with model: loss = call()
    loss.backward()
    assert model.syncs == [], '; '.join(model.syncs)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (x, *(t for g in gs for t in (g.scores, g.final_scores))))

def test_graph_lattice_argmax_and_marginals_on_the_device_read_nothing_back(monkeypatch):
    """GraphLattice on the CUDA path with its emissions, lengths and graphs' scores on the device, as a GPU would run it
    (`on_host` False): once warm, building the lattice and asking argmax and the marginals read nothing back from the
    device and copy nothing to it (`_DeviceModel`): the lengths stay where they are (the CPU kernels' host copy is made
    only for the walks that need it), the path is written on the device."""
    import seqdist.checks
    lp, lengths, gs, which = _batch(0, torch.float32, N=4)
    lengths[0] = 3
    gs = [Graph(g.src, g.dst, g.labels, g.scores.clone(), g.start, g.finals, g.final_scores.clone(), num_states=g.num_states)
          for g in gs]
    graphs = [gs[i] for i in which]
    def ask():
        p = G.GraphLattice(lp, lengths, graphs, backend='cuda')
        return p.argmax, p.marginals
    want = ask()
    for module in (G, seqdist.checks): monkeypatch.setattr(module, 'on_host', lambda *xs: False, raising=False)
    ask()                                                              # warm: the kernel built, the structure packed
    model = _watched_device(monkeypatch, [lp, lengths, *(t for g in gs for t in (g.scores, g.final_scores))])
    with model: got = ask()
    assert model.syncs == [], '; '.join(model.syncs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
@pytest.mark.parametrize('bad', [[9, 10, 3, 0], [9, -1, 3, 0]])
def test_lengths_out_of_range_give_a_named_value_error_on_cpu_tensors(backend, bad):
    lp, lengths, gs, which = _batch(1, torch.float64)
    with pytest.raises(ValueError, match=r"input_lengths must be in \[0, T\] = \[0, 9\], got values in \[-?\d+, \d+\]"):
        graph_loss(lp, torch.tensor(bad), [gs[i] for i in which], backend=backend)

def test_lengths_out_of_range_on_a_device_are_asserted_there(monkeypatch):
    "As on a GPU (`on_host` False): no host read, the device's assertion (here the CPU's, at once) names the check."
    lp, lengths, gs, which = _batch(1, torch.float64)
    monkeypatch.setattr(G, 'on_host', lambda *xs: False)
    graph_loss(lp, lengths, [gs[i] for i in which], backend='cuda')                  # (in range: no assertion)
    with pytest.raises(RuntimeError, match=r"input_lengths out of \[0, T\]"):
        graph_loss(lp, torch.tensor([9, 10, 3, 0]), [gs[i] for i in which], backend='cuda')

@pytest.mark.parametrize('on_device', [False, True])
def test_a_nan_or_inf_in_a_graphs_scores_poisons_its_sequences_alone(monkeypatch, on_device):
    """A NaN arc score in one graph and a +inf final score in another: NaN log Z and gradients for the sequences of
    those graphs, the others untouched; the CUDA path's check, on the device (and as a GPU runs it), as the CPU's."""
    import seqdist.checks
    if on_device:
        for module in (G, seqdist.checks): monkeypatch.setattr(module, 'on_host', lambda *xs: False)
    lp, lengths, gs, which = _batch(2, torch.float64, N=6)
    lengths[:] = 9
    w, f = gs[0].scores.clone(), gs[2].final_scores.clone()
    w[1], f[0] = math.nan, math.inf
    gs = [Graph(gs[0].src, gs[0].dst, gs[0].labels, w, gs[0].start, gs[0].finals, gs[0].final_scores, num_states=gs[0].num_states),
          gs[1], Graph(gs[2].src, gs[2].dst, gs[2].labels, gs[2].scores, gs[2].start, gs[2].finals, f, num_states=gs[2].num_states)]
    which = [0, 1, 2, 1, 0, 1]
    out = {}
    for backend in ('cpu', 'cuda'):
        x = lp.clone().requires_grad_()
        z = graph_logz(x, lengths, [gs[i] for i in which], backend=backend)
        out[backend] = z.detach(), torch.autograd.grad(torch.where(z == -math.inf, 0, z).sum(), x)[0]
    torch.testing.assert_close(out['cuda'], out['cpu'], equal_nan=True, **TOL[torch.float64])
    assert out['cuda'][0].isnan().tolist() == [True, False, True, False, True, False]
    assert out['cuda'][1].isnan().any(-1).any(0).tolist() == [True, False, True, False, True, False]
