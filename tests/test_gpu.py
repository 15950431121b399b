"""On a CUDA device (`make gpu-check`; skipped, visibly, on a machine without one): the CUDA paths agree with the CPU
ones, are deterministic, take index tensors on any device as seqdist 0.0.3 did, and make no host-device
synchronisation in their hot path once warm."""
import pytest, torch
import torch.nn.functional as F
from seqdist.core import Log
from seqdist.crf import CTC_CRF
from seqdist.ctc import ctc_loss
from seqdist import sparse

pytestmark = pytest.mark.gpu

def _grad(f, x):
    x = x.detach().requires_grad_()
    loss = f(x)
    g, = torch.autograd.grad(loss, x)
    return loss.detach(), g

def crf_inputs(T=60, N=4, state_len=3, seed=0, device='cuda'):
    g = torch.Generator().manual_seed(seed)
    crf = CTC_CRF(state_len, 'NACGT')
    scores = torch.randn(T, N, crf.n_score(), generator=g)
    targets = torch.randint(1, 5, (N, 12), generator=g)
    targets[0, :8] = 1                                                   # repeated k-mers
    lengths = torch.randint(9, 13, (N,), generator=g)
    return crf, scores.to(device), targets, lengths

def test_bonito_style_call_with_cpu_idx_and_cuda_scores():
    "bonito 0.5.0 passes its CPU int32 idx with CUDA scores to seqdist.sparse.logZ (it crashed in the backward)."
    crf, scores, targets, lengths = crf_inputs()
    T, N, _ = scores.shape
    Ms = scores.reshape(T, N, -1, crf.n_base + 1)
    v = Ms.new_zeros(N, crf.n_states)
    assert crf.idx.device.type == 'cpu'
    z, g = _grad(lambda x: sparse.logZ(x, crf.idx, v, v, Log, K=1).sum(), Ms)
    z_cpu, g_cpu = _grad(lambda x: sparse.logZ(x, crf.idx, v.cpu().double(), v.cpu().double(), Log, K=1).sum(), Ms.cpu().double())
    torch.testing.assert_close(z.cpu().double(), z_cpu, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(g.cpu().double(), g_cpu, rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize('log2', ['0', '1'])    # '1': the recursions in base 2 ($SEQDIST_SPARSE_LOG2, _CTC_SIMPLE_LOG2)
def test_ctc_crf_gradients_are_bitwise_reproducible_and_agree_with_the_cpu(log2, monkeypatch):
    monkeypatch.setenv('SEQDIST_SPARSE_LOG2', log2); monkeypatch.setenv('SEQDIST_CTC_SIMPLE_LOG2', log2)
    crf, scores, targets, lengths = crf_inputs(T=200, N=8, state_len=5)
    f = lambda x: crf.ctc_loss(x, targets.cuda(), lengths.cuda())
    (l1, g1), (l2, g2) = _grad(f, scores), _grad(f, scores)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    lc, gc = _grad(lambda x: crf.ctc_loss(x, targets, lengths), scores.cpu().double())
    torch.testing.assert_close(l1.cpu().double(), lc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g1.cpu().double(), gc, rtol=1e-4, atol=1e-5)

@pytest.mark.parametrize('posteriors', ['thread', 'warp'])   # SEQDIST_CTC_POSTERIORS: ctc_posteriors or its warp variant
@pytest.mark.parametrize('C', [20, 1000])     # 1000: more classes than states, the states-to-labels kernel
def test_ctc_loss_agrees_with_pytorch_and_is_deterministic(C, posteriors, monkeypatch):
    monkeypatch.setenv('SEQDIST_CTC_POSTERIORS', posteriors)
    g = torch.Generator().manual_seed(0)
    T, N = 100, 8
    lp = torch.randn(T, N, C, generator=g).log_softmax(2).cuda()
    targets = torch.randint(1, C, (N, 30), generator=g).cuda()
    il, tl = torch.full((N,), T).cuda(), torch.randint(10, 31, (N,), generator=g).cuda()
    (l1, g1), (l2, g2) = [_grad(lambda x: ctc_loss(x, targets, il, tl), lp) for _ in range(2)]
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    lt, gt = _grad(lambda x: F.ctc_loss(x, targets.cpu(), il.cpu(), tl.cpu()), lp.cpu().double())
    torch.testing.assert_close(l1.cpu().double(), lt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g1.cpu().double(), gt, rtol=1e-4, atol=1e-5)

@pytest.mark.parametrize('variant', ['both', 'split', 'smem', 'split+smem', 'smem+log2', 'split+smem+log2'])
def test_ctc_recursion_variants_keep_pytorchs_float32_error(variant, monkeypatch):
    """Every SEQDIST_CTC_VARIANT on a real GPU (the emulator runs a block's threads in turn, and computes log2's ex2 and
    lg2 exactly): odd and even lengths, so the two recursions meet at every kind of middle frame; deterministic; the
    losses within 16 float32 roundings of float64's, the gradient within twice F.ctc_loss's own float32 error."""
    monkeypatch.setenv('SEQDIST_CTC_VARIANT', variant)
    g = torch.Generator().manual_seed(2)
    T, N, C = 301, 8, 20
    lp = torch.randn(T, N, C, generator=g).log_softmax(2).cuda()
    targets = torch.randint(1, C, (N, 100), generator=g).cuda()
    il, tl = torch.tensor([301, 300, 299, 250, 201, 120, 3, 1]).cuda(), torch.tensor([100, 99, 60, 80, 100, 40, 1, 0]).cuda()
    (l1, g1), (l2, g2) = [_grad(lambda x: ctc_loss(x, targets, il, tl, reduction='none').sum(), lp) for _ in range(2)]
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    losses = ctc_loss(lp, targets, il, tl, reduction='none').cpu().double()
    args = targets.cpu(), il.cpu(), tl.cpu()
    exact = F.ctc_loss(lp.cpu().double(), *args, reduction='none')
    assert ((losses - exact).abs() <= 16 * torch.finfo(torch.float32).eps * exact.abs()).all(), (losses - exact)
    _, g64 = _grad(lambda x: F.ctc_loss(x, *args, reduction='sum'), lp.cpu().double())
    _, g32 = _grad(lambda x: F.ctc_loss(x, *args, reduction='sum'), lp.cpu())
    assert (g1.cpu().double() - g64).abs().max() <= 2 * (g32.double() - g64).abs().max()

def _ctc_inputs_on_gpu(T=120, N=8, C=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(T, N, C, generator=g).log_softmax(2).cuda()
    targets = torch.randint(1, C, (N, 30), generator=g).cuda()
    il = torch.randint(T - 20, T + 1, (N,), generator=g).cuda()
    tl = torch.randint(10, 31, (N,), generator=g).cuda()
    return lp, targets, il, tl

def _no_sync(f):
    "Run f with every host-device synchronisation made an error (after a warm-up run outside)."
    f()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try: f()
    finally: torch.cuda.set_sync_debug_mode(0)

def test_hot_paths_do_not_synchronise_with_gpu_resident_inputs():
    lp, targets, il, tl = _ctc_inputs_on_gpu()
    x = lp.detach().requires_grad_()
    _no_sync(lambda: ctc_loss(x, targets, il, tl).backward())
    crf, scores, _, _ = crf_inputs(T=50, N=4, state_len=3)
    Ms = scores.reshape(50, 4, -1, crf.n_base + 1).detach().requires_grad_()
    idx, v = crf.idx.cuda(), Ms.new_zeros(4, crf.n_states)
    _no_sync(lambda: sparse.logZ(Ms, idx, v, v, Log).sum().backward())
    from seqdist import ctc_simple
    stay, move = torch.randn(40, 4, 10).cuda().requires_grad_(), torch.randn(40, 4, 9).cuda().requires_grad_()
    lengths = torch.tensor([10, 7, 9, 3]).cuda()
    _no_sync(lambda: ctc_simple.logZ(stay, move, lengths).sum().backward())

def _replays_in_a_cuda_graph(loss_fn, x, new_x):
    """Capture loss_fn(x) and its backward in a CUDA graph, replay it on new_x's values, and check the loss and the
    gradient against eager calls: what the issue asks of every op (no host sync, no host-side state per call)."""
    static = x.detach().clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                    # warm-up: kernels compiled, caches filled
        for _ in range(3):
            static.grad = None
            loss_fn(static).backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    static.grad = None
    with torch.cuda.graph(graph):
        static_loss = loss_fn(static)
        static_loss.backward()
    with torch.no_grad(): static.copy_(new_x)
    graph.replay()
    loss, grad = _grad(loss_fn, new_x)
    torch.testing.assert_close(static_loss.detach(), loss)
    torch.testing.assert_close(static.grad, grad)

def test_ctc_loss_forward_and_backward_replay_in_a_cuda_graph():
    lp, targets, il, tl = _ctc_inputs_on_gpu()
    _replays_in_a_cuda_graph(lambda x: ctc_loss(x, targets, il, tl), lp, _ctc_inputs_on_gpu(seed=2)[0])

def test_crf_ops_replay_in_a_cuda_graph():
    from seqdist import ctc_simple
    crf, scores, targets, lengths = crf_inputs(T=50, N=4, state_len=3)
    targets, lengths = targets.cuda(), lengths.cuda()
    _replays_in_a_cuda_graph(lambda x: crf.ctc_loss(x, targets, lengths), scores, crf_inputs(T=50, N=4, state_len=3, seed=1)[1])
    Ms = scores.reshape(50, 4, -1, crf.n_base + 1)
    idx, v = crf.idx.cuda(), Ms.new_zeros(4, crf.n_states)
    _replays_in_a_cuda_graph(lambda x: sparse.logZ(x, idx, v, v, Log).sum(), Ms, torch.randn_like(Ms))
    move, tl = torch.randn(40, 4, 9).cuda(), torch.tensor([10, 7, 9, 3]).cuda()
    _replays_in_a_cuda_graph(lambda x: ctc_simple.logZ(x, move, tl).sum(), torch.randn(40, 4, 10).cuda(), torch.randn(40, 4, 10).cuda())


# ---------------------------------------------------------------------------------------------------------------------
# Every family, every concern: one case builder per family (inputs on a device, in a dtype; variable lengths; a `long`
# size that takes the kernels' looping paths), one helper per concern, parametrised by family. A failure names the
# family, the size, the shapes and the dtype. The per-family summary at the end of `make gpu-check` comes from the
# user properties these tests record (tests/conftest.py).
from seqdist.utils import count_launches

class Case:
    "A family's inputs on one device: `x` the differentiable input, `f(x)` its outputs (a scalar loss first, if differentiable)."
    def __init__(self, name, x, f, differentiable=True, bound=None):
        self.name, self.x, self.f, self.differentiable, self.bound = name, x, f, differentiable, bound
    def __repr__(self): return f"{self.name}: x {tuple(self.x.shape)} {self.x.dtype} on {self.x.device}"

def _gen(seed): return torch.Generator().manual_seed(seed)

def _ctc_case(size, dtype, device, seed=0):
    T, N, C, L = dict(small=(120, 6, 20, 30), long=(2200, 2, 8, 1100))[size]   # long: > 4 states per thread
    g = _gen(seed)
    lp = torch.randn(T, N, C, generator=g, dtype=torch.float64).log_softmax(2).to(device, dtype)
    targets = torch.randint(1, C, (N, L), generator=g)
    targets[0, 1::2] = targets[0, 0::2][:targets[0, 1::2].shape[0]]                  # repeated labels
    il = torch.randint(T - T // 5, T + 1, (N,), generator=g); il[0] = T
    tl = torch.randint(L // 2, L + 1, (N,), generator=g); tl[0] = L // 2
    targets, il, tl = targets.to(device), il.to(device), tl.to(device)
    return Case('ctc_loss', lp, lambda x: (ctc_loss(x, targets, il, tl, reduction='sum'),),
                bound=lambda: 4 * T * N * max(C, 2 * L + 1) * 8)                  # state weights, posteriors, gradient

def _forced_align_case(size, dtype, device, seed=0):
    from seqdist.ctc import forced_align
    T, N, C, L = dict(small=(100, 5, 12, 30), long=(1500, 2, 6, 700))[size]
    g = _gen(seed)
    lp = torch.randn(N, T, C, generator=g, dtype=torch.float64).log_softmax(2).to(device, dtype)
    targets = torch.randint(1, C, (N, L), generator=g).to(device)
    il = torch.randint(T - 10, T + 1, (N,), generator=g).to(device)
    tl = torch.randint(L // 2, L + 1, (N,), generator=g).to(device)
    return Case('forced_align', lp, lambda x: forced_align(x, targets, il, tl), differentiable=False,
                bound=lambda: T * N * (2 * L + 1) + 4 * T * N * 8 + (1 << 20))     # back-pointers (bytes), states, outputs

def _ctc_simple_case(size, dtype, device, seed=0):
    from seqdist import ctc_simple
    T, N, L = dict(small=(60, 5, 12), long=(400, 2, 1500))[size]                  # long: more states than threads
    g = _gen(seed)
    x = torch.randn(T, N, 2 * L - 1, generator=g, dtype=torch.float64).to(device, dtype)   # stay (L) and move (L-1)
    lengths = torch.randint(L // 2, L + 1, (N,), generator=g); lengths[0] = L
    lengths = lengths.to(device)
    return Case('ctc_simple.logZ', x, lambda x: (ctc_simple.logZ(x[..., :L], x[..., L:], lengths).sum(),),
                bound=lambda: 6 * T * N * L * 8)

def _crf_parts(size, seed):
    from seqdist.crf import CTC_CRF
    T, N, state_len = dict(small=(60, 4, 3), long=(300, 3, 5))[size]
    g = _gen(seed)
    crf = CTC_CRF(state_len, 'NACGT')
    scores = torch.randn(T, N, crf.n_score(), generator=g, dtype=torch.float64)
    targets = torch.randint(1, 5, (N, T // 5), generator=g)
    targets[0, :8] = 1                                                             # repeated k-mers
    lengths = torch.randint(T // 10, T // 5 + 1, (N,), generator=g)
    return crf, scores, targets, lengths

def _sparse_case(size, dtype, device, seed=0):
    crf, scores, _, _ = _crf_parts(size, seed)
    T, N, _ = scores.shape
    Ms = scores.reshape(T, N, -1, crf.n_base + 1).to(device, dtype)
    idx, v = crf.idx.to(device), Ms.new_zeros(N, crf.n_states)
    return Case('sparse.logZ', Ms, lambda x: (sparse.logZ(x, idx, v, v, Log).sum(),), bound=lambda: 6 * Ms.numel() * 8)

def _crf_case(size, dtype, device, seed=0):
    crf, scores, targets, lengths = _crf_parts(size, seed)
    targets, lengths = targets.to(device), lengths.to(device)
    return Case('CTC_CRF.ctc_loss', scores.to(device, dtype), lambda x: (crf.ctc_loss(x, targets, lengths),),
                bound=lambda: 8 * scores.numel() * 8)

def _transducer_bound(logits, per_node):
    """The transducer issues' bound, 1.1x the logits + 1 MB, plus the lattice the kernels keep: `per_node` float64 a node
    (B T (U+1) nodes). At the benchmarks' V (>= 128) that lattice is under 5% of the logits; in the 'long' cases' V = 5
    it is larger than the logits, so the bound names it rather than hiding it in the 10%."""
    return 1.1 * logits.numel() * logits.element_size() + per_node * 8 * logits[..., 0].numel() + (1 << 20)

def _rnnt_case(size, dtype, device, seed=0):
    from seqdist.rnnt import rnnt_loss
    B, T, U, V = dict(small=(3, 30, 12, 20), long=(2, 40, 1500, 5))[size]         # long: more rows than threads
    g = _gen(seed)
    logits = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64).to(device, dtype)
    targets = torch.randint(0, V - 1, (B, U), generator=g, dtype=torch.int32).to(device)   # blank = V - 1
    ll = torch.randint(T // 2, T + 1, (B,), generator=g, dtype=torch.int32); ll[0] = T
    tl = torch.randint(U // 2, U + 1, (B,), generator=g, dtype=torch.int32); tl[0] = U
    ll, tl = ll.to(device), tl.to(device)
    return Case('rnnt_loss', logits, lambda x: (rnnt_loss(x, targets, ll, tl, reduction='sum'),),
                bound=lambda: _transducer_bound(logits, 3))   # lse, alpha, beta: 3 float64 a node

def _tdt_parts(size, seed, V_extra):
    B, T, U, V = dict(small=(3, 30, 12, 20), long=(2, 40, 1500, 5))[size]         # long: more nodes than threads
    g = _gen(seed)
    logits = torch.randn(B, T, U + 1, V + V_extra, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V - 3, (B, U), generator=g, dtype=torch.int32)      # (below blank V-1 and 2 big blanks)
    ll = torch.randint(T // 2, T + 1, (B,), generator=g, dtype=torch.int32); ll[0] = T
    tl = torch.randint(U // 2, U + 1, (B,), generator=g, dtype=torch.int32); tl[0] = U
    return logits, targets, ll, tl, V

def _tdt_case(size, dtype, device, seed=0):
    from seqdist.tdt import tdt_loss
    logits, targets, ll, tl, V = _tdt_parts(size, seed, 5)
    logits, targets, ll, tl = logits.to(device, dtype), targets.to(device), ll.to(device), tl.to(device)
    return Case('tdt_loss', logits, lambda x: (tdt_loss(x, targets, ll, tl, (0, 1, 2, 3, 4), sigma=0.05, omega=0.1,
                                                        fastemit_lambda=0.01, reduction='sum'),),
                bound=lambda: _transducer_bound(logits, 2 + 2 * 2))   # 2 + 2 L float64 a node: L = 2 lattices (omega > 0)

def _multiblank_case(size, dtype, device, seed=0):
    from seqdist.tdt import multiblank_rnnt_loss
    logits, targets, ll, tl, V = _tdt_parts(size, seed, 0)
    logits, targets, ll, tl = logits.to(device, dtype), targets.to(device), ll.to(device), tl.to(device)
    return Case('multiblank_rnnt_loss', logits, lambda x: (multiblank_rnnt_loss(x, targets, ll, tl, (2, 4), sigma=0.05,
                                                                                delay_penalty=0.01, reduction='sum'),),
                bound=lambda: _transducer_bound(logits, 2 + 2 * 1))   # 2 + 2 L float64 a node: one lattice

def _gru_case(size, dtype, device, seed=0):
    from seqdist.gru import GRU
    T, N, I, H = dict(small=(20, 4, 16, 32), long=(60, 3, 8, 300))[size]          # long: H past one block
    torch.manual_seed(seed)
    gru = GRU(I, H, num_layers=2, bidirectional=True).to(torch.float64)
    g = _gen(seed)
    x = torch.randn(T, N, I, generator=g, dtype=torch.float64).to(device, dtype)
    r = torch.randn(T, N, 2 * H, generator=g, dtype=torch.float64).to(device, dtype)
    lengths = torch.randint(T // 2, T + 1, (N,), generator=g); lengths[0] = T
    gru, lengths = gru.to(device, dtype), lengths.to(device)
    def f(x):
        out, h = gru(x, None, lengths)
        return ((out * r).sum() + h.sum(),)
    return Case('GRU', x, f, bound=lambda: 12 * T * N * 2 * H * 2 * 8 + 4 * sum(p.numel() for p in gru.parameters()) * 8)

def _cross_entropy_case(size, dtype, device, seed=0):
    from seqdist.cross_entropy import cross_entropy
    N, V = dict(small=(64, 1000), long=(33, 70000))[size]                          # long: rows past one block's loop
    g = _gen(seed)
    x = (3 * torch.randn(N, V, generator=g, dtype=torch.float64)).to(device, dtype)
    target = torch.randint(0, V, (N,), generator=g); target[::7] = -100              # some ignored
    target = target.to(device)
    return Case('cross_entropy', x, lambda x: (cross_entropy(x, target),),
                bound=lambda: 1.05 * x.numel() * x.element_size() + (1 << 20))     # the gradient, and O(N)

def _linear_cross_entropy_case(size, dtype, device, seed=0):
    from seqdist.cross_entropy import linear_cross_entropy, LCE_CHUNK_BYTES
    N, H, V = dict(small=(48, 32, 500), long=(300, 64, 30000))[size]
    g = _gen(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64).to(device, dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5).to(device, dtype)
    target = torch.randint(0, V, (N,), generator=g); target[::5] = -100
    target = target.to(device)
    return Case('linear_cross_entropy', x, lambda x: (linear_cross_entropy(x, w, target),),   # positional only
                bound=lambda: 2 * LCE_CHUNK_BYTES + 2 * (x.numel() + w.numel()) * 8 + (1 << 20))   # chunk buffers, grads

def _linear_token_stats_case(size, dtype, device, seed=0):
    from seqdist.cross_entropy import linear_token_stats, LCE_CHUNK_BYTES
    N, H, V = dict(small=(48, 32, 500), long=(300, 64, 30000))[size]
    g = _gen(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64).to(device, dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5).to(device, dtype)
    b = (torch.randn(V, generator=g, dtype=torch.float64) / 10).to(device, dtype)
    target = torch.randint(0, V, (N,), generator=g); target[::5] = -100
    advantage = torch.randn(N, generator=g, dtype=torch.float64).to(device)
    target = target.to(device)
    def f(x):                                        # an RL loss: advantage-weighted log-probs and an entropy bonus
        logp, ent = linear_token_stats(x, w, target, linear_bias=b, temperature=0.7, softcap=20.0)
        return (advantage.to(logp.dtype) * logp + 0.01 * ent).sum(), logp, ent
    return Case('linear_token_stats', x, f,
                bound=lambda: 2 * LCE_CHUNK_BYTES + 2 * (x.numel() + w.numel() + V) * 8 + (1 << 20))   # chunks, grads

def _joint_case(size, dtype, device, seed=0):
    from seqdist.joint import joint_rnnt_loss, JOINT_TILE_BYTES, JOINT_CUDA_TILE_BYTES, JOINT_CUDA_TILE_SHARE
    B, T, U, V, H = dict(small=(3, 30, 12, 40, 16), long=(2, 60, 40, 3000, 64))[size]   # long: rows past a block, tiles
    g = _gen(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    e, p, W, bias = r(B, T, H), r(B, U + 1, H), r(V, H) / H ** 0.5, r(V) / 10
    targets = torch.randint(0, V - 1, (B, U), generator=g)                             # blank = V - 1
    ll = torch.randint(T // 2, T + 1, (B,), generator=g); ll[0] = T
    tl = torch.randint(U // 2, U + 1, (B,), generator=g); tl[0] = U
    p, W, bias = (x.to(device, dtype) for x in (p, W, bias))
    targets, ll, tl = targets.to(device), ll.to(device), tl.to(device)
    logits = B * T * (U + 1) * V * torch.empty(0, dtype=dtype).element_size()          # a tile's logits, at most:
    tile = min(JOINT_CUDA_TILE_BYTES, max(256 << 10, logits // JOINT_CUDA_TILE_SHARE)) if 'cuda' in str(device) else JOINT_TILE_BYTES
    return Case('joint_rnnt_loss', e.to(device, dtype),
                lambda x: (joint_rnnt_loss(x, p, W, targets, ll, tl, bias, 'tanh', reduction='sum', fastemit_lambda=0.01),),
                bound=lambda: 2 * tile * (1 + 2 * (H + 1) / V) + 128 * B * T * (U + 1)
                              + 16 * (e.numel() + p.numel() + W.numel() + V) + (1 << 20))   # tiles, per node, gradients

def _ctc_divergence_case(size, dtype, device, seed=0):
    """The CTC lattice questions entropy and KL (op ctc_divergence): on a GPU the CUDA kernel `ctc_divergence`, on the
    CPU the numba kernel: agreement checks one against the other."""
    from seqdist.ctc import alignment_entropy, alignment_kl
    T, N, C, L = dict(small=(30, 3, 6, 8), long=(200, 4, 20, 40))[size]
    g = _gen(seed)
    x = torch.randn(T, N, C, generator=g, dtype=torch.float64).log_softmax(-1).to(device, dtype)
    q = torch.randn(T, N, C, generator=g, dtype=torch.float64).log_softmax(-1).to(device, dtype)
    targets = torch.randint(1, C, (N, L), generator=g).to(device)
    il, tl = torch.full((N,), T).to(device), torch.randint(L // 2, L + 1, (N,), generator=g).to(device)
    def f(x):
        h, kl = alignment_entropy(x, targets, il, tl), alignment_kl(x, q, targets, il, tl)
        return h.sum() + kl.sum(), h, kl
    return Case('alignment_entropy, alignment_kl', x, f,
                bound=lambda: 400 * T * N * (2 * L + 1) * 8 + 8 * x.numel() * 8 + (1 << 20))   # the reference's autograd graph

def _rnnt_divergence_case(size, dtype, device, seed=0):
    """RNN-T's entropy and KL (op rnnt_divergence): on a GPU the CUDA kernels `rnnt_divergence` and
    `rnnt_divergence_grad`, on the CPU the numba kernel."""
    from seqdist.rnnt import alignment_entropy, alignment_kl
    B, T, U, V = dict(small=(3, 12, 5, 8), long=(2, 60, 20, 16))[size]
    g = _gen(seed)
    x = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64).to(device, dtype)
    q = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64).to(device, dtype)
    targets = torch.randint(0, V - 1, (B, U), generator=g, dtype=torch.int32).to(device)     # blank = V - 1
    ll = torch.randint(T // 2, T + 1, (B,), generator=g, dtype=torch.int32); ll[0] = T
    tl = torch.randint(U // 2, U + 1, (B,), generator=g, dtype=torch.int32); tl[0] = U
    ll, tl = ll.to(device), tl.to(device)
    def f(x):
        h, kl = alignment_entropy(x, targets, ll, tl), alignment_kl(x, q, targets, ll, tl)
        return h.sum() + kl.sum(), h, kl
    return Case('rnnt alignment_entropy, alignment_kl', x, f,    # gradients (p's twice, q's) and their scaled copies;
                bound=lambda: 6 * x.numel() * x.element_size() + 16 * 8 * B * T * (U + 1) + (1 << 20))  # 12 float64 a node

def _tdt_divergence_case(size, dtype, device, seed=0):
    """TDT's entropy and KL, multi-blank's entropy (op tdt_divergence): on a GPU `tdt_lse`, `tdt_divergence` and
    `tdt_divergence_grad`, on the CPU the numba kernel."""
    from seqdist.tdt import alignment_entropy, alignment_kl, multiblank_alignment_entropy
    B, T, U, V = dict(small=(3, 12, 5, 8), long=(2, 40, 20, 16))[size]
    g = _gen(seed)
    x = torch.randn(B, T, U + 1, V + 5, generator=g, dtype=torch.float64).to(device, dtype)     # durations 0..4
    q = torch.randn(B, T, U + 1, V + 5, generator=g, dtype=torch.float64).to(device, dtype)
    targets = torch.randint(0, V - 3, (B, U), generator=g, dtype=torch.int32).to(device)     # (below blank V-1 and 2 big blanks)
    ll = torch.randint(T // 2, T + 1, (B,), generator=g, dtype=torch.int32); ll[0] = T
    tl = torch.randint(U // 2, U + 1, (B,), generator=g, dtype=torch.int32); tl[0] = U
    ll, tl = ll.to(device), tl.to(device)
    def f(x):
        h = alignment_entropy(x, targets, ll, tl, (0, 1, 2, 3, 4), sigma=0.05)
        kl = alignment_kl(x, q, targets, ll, tl, (0, 1, 2, 3, 4), sigma=0.05)
        hm = multiblank_alignment_entropy(x[..., :V], targets, ll, tl, (2, 3))
        return h.sum() + kl.sum() + hm.sum(), h, kl, hm
    return Case('tdt alignment_entropy, alignment_kl, multiblank_alignment_entropy', x, f,   # the gradients (p's three,
                bound=lambda: 6 * x.numel() * x.element_size() + 64 * 8 * B * T * (U + 1) + (1 << 20))  # q's) and KL's
                                                                         # 46 float64 a node: lse, states, 2 x 9 edges a side

def _crf_divergence_case(size, dtype, device, seed=0):
    "CTC_CRF's entropy and KL over paths (op crf_divergence): on a GPU the CUDA kernel crf_divergence, on the CPU numba's."
    crf, scores, targets, lengths = _crf_parts(size, seed)
    q = torch.randn(scores.shape, generator=_gen(seed + 1), dtype=torch.float64).to(device, dtype)
    def f(x):
        h, kl = crf.entropy(x), crf.kl(x, q)
        return h.sum() + kl.sum(), h, kl
    T, N = scores.shape[:2]
    x = scores.to(device, dtype)
    return Case('CTC_CRF.entropy, CTC_CRF.kl', x, f,        # gradients and the kernels' copies of the scores (10 in all at
                bound=lambda: 10 * x.numel() * x.element_size() + 56 * N * (T + 1) * crf.n_states + (1 << 20))   # most),
                                                            # both recursions' states, every frame (3 float64 each: split)

def _graph_case(size, dtype, device, seed=0):
    """graph_loss (op graph_logz) over CTC graphs (long: more states than a block's 256 threads) and a random graph with
    epsilon arcs, their arc and final scores learnable and on the lengths' device: on a GPU the CUDA kernel graph_logz."""
    from seqdist.graph import Graph, graph_loss, random_graph, ctc_graph
    T, N, C, L = dict(small=(60, 4, 8, 12), long=(700, 3, 8, 300))[size]
    g = _gen(seed)
    lp = torch.randn(T, N, C, generator=g, dtype=torch.float64).log_softmax(2).to(device, dtype)
    targets = torch.randint(1, C, (N - 1, L), generator=g)
    targets[0, 1] = targets[0, 0]                                                      # a repeated label
    tl = torch.randint(L // 2, L + 1, (N - 1,), generator=g)
    graphs = [Graph(x.src, x.dst, x.labels, x.scores.to(device).requires_grad_(), x.start, x.finals,
                    x.final_scores.to(device).requires_grad_(), num_states=x.num_states)
              for x in ctc_graph(targets, tl) + [random_graph(10, 30, C, generator=_gen(seed + 1))]]
    il = torch.randint(T - T // 5, T + 1, (N,), generator=g).to(device)
    S, E = max(x.num_states for x in graphs), max(x.num_arcs for x in graphs)
    return Case('graph_loss', lp, lambda x: (graph_loss(x, il, graphs, reduction='sum', zero_infinity=True),),
                bound=lambda: 4 * lp.numel() * 4 + 16 * N * (T + 1) * S + 16 * N * (E + S) + (1 << 20))  # forward scores,
                                                                        # beta, posteriors, gradient, the layout's copy

FAMILIES = {'ctc': _ctc_case, 'forced_align': _forced_align_case, 'ctc_simple': _ctc_simple_case, 'sparse': _sparse_case,
            'crf': _crf_case, 'rnnt': _rnnt_case, 'gru': _gru_case, 'cross_entropy': _cross_entropy_case,
            'linear_cross_entropy': _linear_cross_entropy_case, 'linear_token_stats': _linear_token_stats_case,
            'tdt': _tdt_case, 'multiblank': _multiblank_case,
            'joint': _joint_case, 'ctc_divergence': _ctc_divergence_case, 'rnnt_divergence': _rnnt_divergence_case,
            'tdt_divergence': _tdt_divergence_case,
            'crf_divergence': _crf_divergence_case, 'graph': _graph_case}
REFERENCE_ON_GPU = set()   # families whose GPU path is the PyTorch reference (its host reads and Python loop not sync-free): none now
HOST_SIDE = set()          # families whose call does host work on the inputs (not sync-free, not capturable): none now
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=1e-4, atol=1e-4)}

def _outputs(case, x=None):
    "The case's outputs on x (its own input if None) and, if differentiable, the gradient of the first w.r.t. x."
    x = (case.x if x is None else x).detach()
    if not case.differentiable: return tuple(o.detach() for o in case.f(x))
    x = x.requires_grad_()
    outs = case.f(x)
    g, = torch.autograd.grad(outs[0], x)
    return tuple(o.detach() for o in outs) + (g,)

def _compare(got, want, tol, what):
    "Largest absolute error of got vs want (on the CPU, float64), asserting closeness; integer outputs must be equal."
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        a = a.cpu()
        if not a.is_floating_point(): assert torch.equal(a, b.cpu()), f"{what}: output {i} differs"; continue
        a, b = a.double(), b.cpu().double()
        torch.testing.assert_close(a, b, **tol, equal_nan=True, msg=lambda m: f"{what}, output {i}: {m}")
        finite = torch.isfinite(b)
        if finite.any(): worst = max(worst, (a[finite] - b[finite]).abs().max().item())
    return worst

@pytest.fixture
def record(request):
    "Records (family, kernels, worst error) for `make gpu-check`'s summary."
    def rec(family, kernels=(), error=None):
        request.node.user_properties.append(('family', family))
        request.node.user_properties.append(('kernels', tuple(sorted(kernels))))
        if error is not None: request.node.user_properties.append(('error', error))
    return rec

@pytest.mark.parametrize('size', ['small', 'long'])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('family', list(FAMILIES))
def test_gpu_agrees_with_cpu(family, dtype, size, record):
    "The CUDA path against the CPU path in float64 (values and gradients), variable lengths, looping paths."
    case, ref = FAMILIES[family](size, dtype, 'cuda'), FAMILIES[family](size, torch.float64, 'cpu')
    with count_launches() as launches: got = _outputs(case)
    torch.cuda.synchronize()
    tol = TOL[dtype] if size == 'small' or dtype == torch.float64 else dict(rtol=1e-4, atol=1e-3)
    err = _compare(got, _outputs(ref), tol, f"{family} ({size}) {case}")
    record(family, launches, err)

DIVERGENCE_VARIANTS = {'ctc_divergence': 'SEQDIST_CTC_DIVERGENCE', 'rnnt_divergence': 'SEQDIST_RNNT_DIVERGENCE',
                       'tdt_divergence': 'SEQDIST_TDT_DIVERGENCE', 'crf_divergence': 'SEQDIST_CRF_DIVERGENCE'}

@pytest.mark.parametrize('size', ['small', 'long'])
@pytest.mark.parametrize('family', list(DIVERGENCE_VARIANTS))
def test_gpu_divergence_variants_give_the_same_bits(family, size, monkeypatch, record):
    """The lattice questions' two CUDA variants (split, the default: both recursions at once, then the edges'
    gradients a thread each; fused: one block a sequence), which the benchmark compares: the same values and
    gradients, bit for bit, in float64."""
    got = {}
    for variant in ('split', 'fused'):
        monkeypatch.setenv(DIVERGENCE_VARIANTS[family], variant)
        got[variant] = _outputs(FAMILIES[family](size, torch.float64, 'cuda'))
    for i, (u, v) in enumerate(zip(got['split'], got['fused'])): assert torch.equal(u, v), f"{family} ({size}): output {i}"
    record(family)

@pytest.mark.parametrize('family', list(FAMILIES))
def test_gpu_bitwise_repeatable(family, record):
    "The same inputs give bit-identical outputs and gradients (no float atomics in reductions)."
    case = FAMILIES[family]('small', torch.float32, 'cuda')
    a, b = _outputs(case), _outputs(case)
    for i, (u, v) in enumerate(zip(a, b)): assert torch.equal(u, v), f"{family} {case}: output {i} differs between runs"
    record(family)

@pytest.mark.parametrize('family', [pytest.param(f, marks=pytest.mark.xfail(reason='the PyTorch reference on a GPU: no CUDA kernel yet')) if f in REFERENCE_ON_GPU else
                                    pytest.param(f, marks=pytest.mark.xfail(reason='host work at each call (HOST_SIDE)')) if f in HOST_SIDE else f for f in FAMILIES])
def test_gpu_no_host_sync(family, record):
    "With every input on the GPU, a warm forward and backward makes no host-device synchronisation."
    case = FAMILIES[family]('small', torch.float32, 'cuda')
    _no_sync(lambda: _outputs(case))
    record(family)

@pytest.mark.parametrize('family', [pytest.param(f, marks=pytest.mark.xfail(reason='the PyTorch reference on a GPU: no CUDA kernel yet')) if f in REFERENCE_ON_GPU else
                                    pytest.param(f, marks=pytest.mark.xfail(reason='host work at each call (HOST_SIDE)')) if f in HOST_SIDE else f for f in FAMILIES])
def test_gpu_cuda_graph_replay(family, record):
    "Forward and backward captured in a CUDA graph replay new inputs' values as eager calls compute them."
    case, new = FAMILIES[family]('small', torch.float32, 'cuda'), FAMILIES[family]('small', torch.float32, 'cuda', seed=1)
    if case.differentiable:
        _replays_in_a_cuda_graph(lambda x: case.f(x)[0], case.x, new.x)
    else:
        static = case.x.clone()
        side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3): case.f(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph): outs = case.f(static)
        static.copy_(new.x)
        graph.replay()
        for i, (u, v) in enumerate(zip(outs, case.f(new.x))): torch.testing.assert_close(u, v, msg=lambda m: f"{family} {case}: output {i}: {m}")
    record(family)

NO_HALF = {'ctc_simple', 'sparse', 'crf'}   # reject fp16/bf16 with a TypeError today (DESIGN asks that they accept them)

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('family', [pytest.param(f, marks=pytest.mark.xfail(raises=TypeError, strict=True,
                                     reason="fp16/bf16 not accepted yet")) if f in NO_HALF else f for f in FAMILIES])
def test_gpu_half_precision_inputs(family, dtype, record):
    """fp16/bf16 inputs (and parameters): computed in float32, gradients in the input's dtype, close to the float32
    result (the inputs' own rounding is the difference)."""
    case, full = FAMILIES[family]('small', dtype, 'cuda'), FAMILIES[family]('small', torch.float32, 'cuda')
    got = _outputs(case)
    if case.differentiable: assert got[-1].dtype == dtype, f"{family} {case}: gradient in {got[-1].dtype}"
    for i, o in enumerate(got):
        if o.is_floating_point(): assert torch.isfinite(o.float()).all(), f"{family} {case}: output {i} not finite"
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=6e-2, atol=6e-2)
    want = _outputs(full)
    if family == 'forced_align':                      # rounding may pick another of two near-equal paths: its total score
        got, want = [got[1].float().sum(1)], [want[1].sum(1)]
    record(family, error=_compare([o.float() for o in got], [o.float() for o in want], tol, f"{family} {case}"))

@pytest.mark.parametrize('family', list(FAMILIES))
def test_gpu_peak_memory_within_bound(family, record):
    "Peak GPU memory of a forward and backward, beyond the inputs, within the family's stated bound."
    case = FAMILIES[family]('long', torch.float32, 'cuda')
    _outputs(case)                                                 # warm: kernels compiled, caches filled
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    outs = _outputs(case)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= case.bound(), f"{family} {case}: {extra / 2**20:.1f} MB extra, bound {case.bound() / 2**20:.1f} MB"
    record(family, error=None)

# Every registered op and every public entry point has a GPU test here: the ops by the families that run them.
OP_FAMILY = {'seqdist::ctc': 'ctc', 'seqdist::ctc_backward': 'ctc', 'seqdist::ctc_simple': 'ctc_simple',
             'seqdist::ctc_simple_backward': 'ctc_simple',
             'seqdist::sparse_logz': 'sparse', 'seqdist::sparse_logz_backward': 'sparse',
             'seqdist::normalised_target_logp': 'crf', 'seqdist::normalised_target_logp_backward': 'crf',
             'seqdist::gather_columns': 'crf', 'seqdist::gather_columns_backward': 'crf',
             'seqdist::rnnt': 'rnnt', 'seqdist::rnnt_backward': 'rnnt', 'seqdist::rnnt_edges': 'rnnt',
             'seqdist::rnnt_edges_backward': 'rnnt', 'seqdist::gru_layer': 'gru',
             'seqdist::gru_layer_backward': 'gru', 'seqdist::cross_entropy_rows': 'cross_entropy',
             'seqdist::cross_entropy_rows_backward': 'cross_entropy', 'seqdist::linear_cross_entropy': 'linear_cross_entropy',
             'seqdist::linear_cross_entropy_backward': 'linear_cross_entropy', 'seqdist::tdt': 'tdt', 'seqdist::tdt_backward': 'tdt',
             'seqdist::joint_rnnt': 'joint', 'seqdist::joint_rnnt_backward': 'joint',
             'seqdist::linear_token_stats': 'linear_token_stats', 'seqdist::linear_token_stats_backward': 'linear_token_stats',
             'seqdist::ctc_divergence': 'ctc_divergence', 'seqdist::ctc_divergence_backward': 'ctc_divergence',
             'seqdist::rnnt_divergence': 'rnnt_divergence', 'seqdist::rnnt_divergence_backward': 'rnnt_divergence',
             'seqdist::crf_divergence': 'crf_divergence', 'seqdist::crf_divergence_backward': 'crf_divergence',
             'seqdist::tdt_divergence': 'tdt_divergence', 'seqdist::tdt_divergence_backward': 'tdt_divergence',
             'seqdist::graph_logz': 'graph', 'seqdist::graph_logz_backward': 'graph'}
PUBLIC = ['ctc_loss', 'forced_align', 'ctc_simple.logZ', 'sparse.logZ', 'CTC_CRF.ctc_loss', 'rnnt_loss', 'GRU',
          'cross_entropy', 'linear_cross_entropy', 'tdt_loss', 'multiblank_rnnt_loss', 'tdt_alignments', 'tdt_best_path',
          'multiblank_alignments', 'joint_rnnt_loss', 'JointRNNTLoss', 'linear_token_stats', 'alignment_entropy', 'alignment_kl',
          'multiblank_alignment_entropy', 'graph_loss', 'graph_logz']

@pytest.mark.parametrize('size', ['small', 'long'])
def test_gpu_tdt_alignments_agree_with_cpu(size, record):
    "TDT posteriors and timestamps, multi-blank best path: the GPU against the CPU in float64."
    from seqdist.core import Max
    from seqdist.tdt import tdt_alignments, tdt_best_path, multiblank_alignments
    logits, targets, ll, tl, V = _tdt_parts(size, 0, 5)
    args = lambda d: (logits.to(d), targets.to(d), ll.to(d), tl.to(d))
    _compare([tdt_alignments(*args('cuda'), (0, 1, 2, 3, 4))], [tdt_alignments(*args('cpu'), (0, 1, 2, 3, 4))], TOL[torch.float64], 'tdt_alignments')
    got, want = tdt_best_path(*args('cuda'), (0, 1, 2, 3, 4)), tdt_best_path(*args('cpu'), (0, 1, 2, 3, 4))
    err = _compare(got, want, TOL[torch.float64], 'tdt_best_path')
    mb = lambda d: multiblank_alignments(args(d)[0][..., :V], *args(d)[1:], (2, 4), S=Max)
    _compare([mb('cuda')], [mb('cpu')], TOL[torch.float64], 'multiblank_alignments')
    record('tdt', error=err)

def test_joint_rnnt_loss_all_four_gradients_agree_with_the_composition_in_float64():
    "The fused loss on the GPU against the composition (joiner + rnnt_loss) on the CPU: loss and all four gradients."
    from seqdist.joint import JointRNNTLoss, joint_logits
    from seqdist.rnnt import rnnt_loss
    torch.manual_seed(0)
    B, T, U, V, H = 4, 50, 20, 300, 32
    m = JointRNNTLoss(H, V, activation='relu', blank=0, reduction='none', fastemit_lambda=0.05).double()
    e, p = torch.randn(B, T, H, dtype=torch.float64), torch.randn(B, U + 1, H, dtype=torch.float64)
    y, il, tl = torch.randint(1, V, (B, U)), torch.tensor([50, 41, 30, 50]), torch.tensor([20, 13, 0, 7])
    want_in = [e.clone().requires_grad_(), p.clone().requires_grad_()]
    want = rnnt_loss(joint_logits(*want_in, m.linear.weight, m.linear.bias), y, il, tl, blank=0, reduction='none',
                     fastemit_lambda=0.05)
    w = torch.arange(1, B + 1, dtype=torch.float64)
    gw = torch.autograd.grad((want * w).sum(), want_in + list(m.parameters()))
    mc = JointRNNTLoss(H, V, activation='relu', blank=0, reduction='none', fastemit_lambda=0.05).double().cuda()
    mc.load_state_dict(m.state_dict())
    got_in = [e.cuda().requires_grad_(), p.cuda().requires_grad_()]
    got = mc(*got_in, y.cuda(), il.cuda(), tl.cuda())
    gg = torch.autograd.grad((got * w.cuda()).sum(), got_in + list(mc.parameters()))
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-9, atol=1e-9)
    for a, b in zip(gg, gw): torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-9 * b.abs().max().item())

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gpu_ctc_samples_equal_the_reference_without_a_host_sync(dtype, record):
    """CTC sample_alignments on the GPU (the loss's forward in float64, ctc_sample's walk): the reference's samples for the same
    generator (the uniforms come from the generator's device), log-probabilities as the reference's, no host sync."""
    from seqdist.ctc import sample_alignments
    g = _gen(0)
    T, N, C, L = 60, 4, 8, 12
    lp = torch.randn(T, N, C, generator=g, dtype=torch.float64).log_softmax(-1).to('cuda', dtype)
    targets, il, tl = torch.randint(1, C, (N, L), generator=g), torch.tensor([60, 50, 60, 13]), torch.tensor([12, 8, 0, 12])
    args = [lp] + [x.cuda() for x in (targets, il, tl)]
    gen = lambda: torch.Generator(device='cuda').manual_seed(1)
    labels, logp = sample_alignments(*args, n=16, generator=gen())                  # (and a warm-up)
    _no_sync(lambda: sample_alignments(*args, n=16, generator=gen()))
    ref_labels, ref_logp = sample_alignments(*args, n=16, generator=gen(), backend='reference')
    assert torch.equal(labels, ref_labels), "the CUDA kernels and the reference differ on the same uniforms"
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(logp, ref_logp, rtol=tol, atol=tol)
    record('ctc_samples')

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gpu_ctc_kbest_equals_the_cpu_kernel_without_a_host_sync(dtype, record):
    "CTC kbest_alignments on the GPU (ctc_kbest): the CPU kernel's paths and scores, bitwise repeatable, no host sync."
    from seqdist.ctc import kbest_alignments
    g = _gen(0)
    T, N, C, L = 60, 4, 8, 12
    lp = torch.randn(T, N, C, generator=g, dtype=torch.float64).log_softmax(-1).to(dtype)
    targets, il, tl = torch.randint(1, C, (N, L), generator=g), torch.tensor([60, 50, 60, 13]), torch.tensor([12, 8, 0, 12])
    want = kbest_alignments(lp, targets, il, tl, k=8, backend='cpu')
    args = [x.cuda() for x in (lp, targets, il, tl)]
    got = kbest_alignments(*args, k=8)                                                # (and a warm-up)
    _no_sync(lambda: kbest_alignments(*args, k=8))
    again = kbest_alignments(*args, k=8)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-5 if dtype == torch.float32 else 1e-12)
    record('ctc_kbest')

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gpu_rnnt_samples_and_kbest_equal_the_reference_without_a_host_sync(dtype, record):
    """RNN-T sample_alignments on the GPU (the loss's forward, rnnt_sample's walk): the reference's samples for the same
    generator and its log-probabilities; kbest_alignments (rnnt_kbest): the CPU kernel's paths and scores, bitwise
    repeatable. Neither makes a host sync."""
    from seqdist.rnnt import sample_alignments, kbest_alignments
    g = _gen(0)
    B, T, U, V = 4, 30, 10, 8
    x = torch.randn(B, T, U + 1, V, generator=g, dtype=torch.float64).to(dtype)
    targets, il, tl = torch.randint(0, V - 1, (B, U), generator=g), torch.tensor([30, 21, 30, 7]), torch.tensor([10, 6, 0, 10])
    args = [x.cuda()] + [a.cuda() for a in (targets, il, tl)]
    gen = lambda: torch.Generator(device='cuda').manual_seed(1)
    frames, logp = sample_alignments(*args, n=16, generator=gen())                  # (and a warm-up)
    _no_sync(lambda: sample_alignments(*args, n=16, generator=gen()))
    ref_frames, ref_logp = sample_alignments(*args, n=16, generator=gen(), backend='reference')
    assert torch.equal(frames, ref_frames), "the CUDA kernels and the reference differ on the same uniforms"
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(logp, ref_logp, rtol=tol, atol=tol)
    want = kbest_alignments(x, targets, il, tl, k=8, backend='cpu')
    got = kbest_alignments(*args, k=8)
    _no_sync(lambda: kbest_alignments(*args, k=8))
    again = kbest_alignments(*args, k=8)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=tol, atol=tol)
    record('rnnt_questions')

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gpu_tdt_samples_equal_the_cpu_without_a_host_sync(dtype, record):
    """TDT sample_alignments on the GPU (the loss's forward, tdt_sample's walk): the reference's samples for the same
    generator, and its log-probabilities; kbest_alignments (tdt_kbest): the CPU kernel's paths and scores, bitwise
    repeatable. No host sync once warm."""
    from seqdist.tdt import sample_alignments, kbest_alignments
    g = _gen(3)
    B, T, U, V, durations = 4, 30, 10, 8, (0, 1, 2, 3, 4)
    x = torch.randn(B, T, U + 1, V + len(durations), generator=g, dtype=torch.float64).to(dtype)
    targets, il, tl = torch.randint(0, V - 1, (B, U), generator=g), torch.tensor([30, 21, 30, 7]), torch.tensor([10, 6, 0, 10])
    args = [x.cuda()] + [a.cuda() for a in (targets, il, tl)]
    gen = lambda: torch.Generator(device='cuda').manual_seed(1)
    got = sample_alignments(*args, durations, sigma=0.05, n=16, generator=gen())                 # (and a warm-up)
    _no_sync(lambda: sample_alignments(*args, durations, sigma=0.05, n=16, generator=gen()))
    want = sample_alignments(*args, durations, sigma=0.05, n=16, generator=gen(), backend='reference')
    for a, b in zip(got[:3], want[:3]): assert torch.equal(a, b), "the CUDA kernels and the reference differ on the same uniforms"
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(got[3], want[3], rtol=tol, atol=tol)
    want = kbest_alignments(x, targets, il, tl, durations, sigma=0.05, k=8, backend='cpu')
    got = kbest_alignments(*args, durations, sigma=0.05, k=8)
    _no_sync(lambda: kbest_alignments(*args, durations, sigma=0.05, k=8))
    again = kbest_alignments(*args, durations, sigma=0.05, k=8)
    for a, b, c in zip(got[:3], want[:3], again[:3]): assert torch.equal(a.cpu(), b) and torch.equal(a, c)
    assert torch.equal(got[3], again[3])
    torch.testing.assert_close(got[3].cpu(), want[3], rtol=tol, atol=tol)
    record('tdt_questions')

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gpu_crf_samples_and_kbest_equal_the_reference_without_a_host_sync(dtype, record):
    """CTC_CRF.sample on the GPU (sparse_fwd's forward scores, crf_sample's walk): the reference's samples for the same
    generator and its log-probabilities, of the paths and of a read's alignments; the paths' with no host sync once warm.
    CTC_CRF.kbest (crf_kbest): the CPU kernel's paths and scores, bitwise repeatable, with no host sync."""
    crf, scores, targets, lengths = crf_inputs(T=40, N=3, state_len=3)
    x = scores.to(dtype)
    gen = lambda: torch.Generator(device='cuda').manual_seed(2)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for t in ({}, dict(targets=targets, target_lengths=lengths)):
        got = crf.sample(x, n=16, generator=gen(), **t)
        want = crf.sample(x, n=16, generator=gen(), backend='reference', **t)
        assert torch.equal(got[0], want[0]), "the CUDA kernels and the reference differ on the same uniforms"
        torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
    _no_sync(lambda: crf.sample(x, n=16, generator=gen()))
    for t in ({}, dict(targets=targets, target_lengths=lengths)):
        want = crf.kbest(x.cpu(), 8, backend='cpu', **{a: v.cpu() for a, v in t.items()})
        got, again = crf.kbest(x, 8, **t), crf.kbest(x, 8, **t)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])
        torch.testing.assert_close(got[1].cpu(), want[1], rtol=tol, atol=tol)
    _no_sync(lambda: crf.kbest(x, 8))
    record('crf_questions')

def test_gpu_forced_align_options_equal_the_cpu(record):
    """forced_align's wildcard, label priors and confidence on CUDA tensors (the priors on the GPU too): the CPU's labels
    and scores, its confidences to rounding."""
    from seqdist.ctc import forced_align
    g = _gen(2)
    lp = torch.randn(3, 40, 6, generator=g).log_softmax(-1)
    targets, il, tl = torch.tensor([[1, 9, 2, 2], [3, 4, 9, 0], [9, 5, 0, 0]]), torch.tensor([40, 31, 12]), torch.tensor([4, 3, 2])
    priors = torch.randn(6, generator=g)
    kw = dict(return_confidence=True, star=9, star_penalty=-0.3, prior_scale=0.5)
    want = forced_align(lp, targets, il, tl, label_log_priors=priors, **kw)
    got = forced_align(lp.cuda(), targets.cuda(), il.cuda(), tl.cuda(), label_log_priors=priors.cuda(), **kw)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-5, atol=1e-6)
    record('forced_align_options')

def test_gpu_linear_token_stats_over_a_group_of_one(record):
    """linear_token_stats and linear_cross_entropy with group= on CUDA tensors (NCCL, one rank): the layout all-gather
    and the all-reduces on the GPU give the call without a group, values and gradients."""
    import tempfile
    import torch.distributed as dist
    from seqdist.cross_entropy import linear_token_stats, linear_cross_entropy
    if dist.is_initialized(): pytest.skip("a process group is already initialised in this process")
    if not dist.is_nccl_available(): pytest.skip("this torch has no NCCL")
    g = _gen(3)
    h, W, b = (torch.randn(*s, generator=g, dtype=torch.float64).cuda() for s in ((37, 24), (300, 24), (300,)))
    t = torch.randint(0, 300, (37,), generator=g).cuda()
    t[3] = -100
    outs = []
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group('nccl', init_method=f'file://{d}/init', rank=0, world_size=1)
        try:
            for group in (None, dist.group.WORLD):
                hh, WW, bb = (v.clone().requires_grad_() for v in (h, W, b))
                lp, ent = linear_token_stats(hh, WW, t, linear_bias=bb, temperature=0.8, group=group)
                ce = linear_cross_entropy(hh, WW, t, linear_bias=bb, z_loss=0.01, group=group)
                outs.append([lp, ent, ce] + list(torch.autograd.grad((0.3 * lp + ent).sum() + ce, [hh, WW, bb])))
        finally:
            dist.destroy_process_group()
    for i, (u, v) in enumerate(zip(*outs)): torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-10, msg=lambda m: f"output {i}: {m}")
    record('linear_token_stats')

def test_gpu_ctc_beam_search_equals_the_cpu_kernel(record):
    "ctc_beam_search on CUDA tensors (the CUDA kernel, backend 'auto'), both semirings, a token LM, hotwords, words with a word LM (and a lexicon), and cuda_ctc_decoder's face: the CPU kernel's hypotheses."
    from seqdist.decode import ctc_beam_search, cuda_ctc_decoder
    g = _gen(3)
    lp = torch.randn(4, 120, 40, generator=g, dtype=torch.float64).mul(3).log_softmax(-1)
    il = torch.tensor([120, 77, 1, 0])
    for semiring, nbest in (('log', 3), ('max', 1)):
        want = ctc_beam_search(lp, il, beam_width=8, nbest=nbest, semiring=semiring, backend='cpu')
        got = ctc_beam_search(lp.cuda(), il.cuda(), beam_width=8, nbest=nbest, semiring=semiring)
        assert [[(h.tokens.tolist(), h.score) for h in x] for x in got] == [[(h.tokens.tolist(), h.score) for h in x] for x in want]
    from seqdist.decode import NGramLM, random_arpa
    toks = [f't{i}' for i in range(40)]
    lm = NGramLM(text=random_arpa(0, toks[1:], order=3, n_per_order=50))
    kw = dict(beam_width=6, tokens=toks, lm=lm, lm_weight=0.6, lm_tokens=True, semiring='max')
    want = ctc_beam_search(lp, il, backend='cpu', **kw)
    got = ctc_beam_search(lp.cuda(), il.cuda(), **kw)                      # ('auto': the CUDA kernel, with the LM)
    assert [[(h.tokens.tolist(), h.score) for h in x] for x in got] == [[(h.tokens.tolist(), h.score) for h in x] for x in want]
    import random
    rng = random.Random(0)                                                  # hotwords: each beam's own tokens
    hot = [(rng.choices(range(1, 40), k=rng.randint(1, 3)), rng.uniform(1, 4)) for _ in range(60)]
    want = ctc_beam_search(lp, il, beam_width=4, nbest=2, hotwords=hot, backend='cpu')
    got = ctc_beam_search(lp.cuda(), il.cuda(), beam_width=4, nbest=2, hotwords=hot)
    assert [[(h.tokens.tolist(), h.score) for h in x] for x in got] == [[(h.tokens.tolist(), h.score) for h in x] for x in want]
    chars = ['-', '|'] + [chr(97 + i % 26) + ('' if i < 26 else 'x') for i in range(38)]   # words spelled, a word LM
    kw = dict(beam_width=6, tokens=chars, lm=NGramLM(text=random_arpa(1, ['a', 'ab', 'cd', 'bx'], order=2, n_per_order=8)),
              lm_weight=0.5, word_score=2.0)
    for extra in ({}, dict(lexicon=['a', 'ab', 'cd', 'bx', 'dd'], whole_words=True, lm_lookahead=True, semiring='max'),
                  dict(merge_delimiters=True, unk_prefix_score=-1.0, nbest=3)):
        want = ctc_beam_search(lp, il, backend='cpu', **kw, **extra)
        got = ctc_beam_search(lp.cuda(), il.cuda(), **kw, **extra)
        assert [[(h.tokens.tolist(), h.score) for h in x] for x in got] == [[(h.tokens.tolist(), h.score) for h in x] for x in want]
    face = cuda_ctc_decoder([str(i) for i in range(40)], blank_skip_threshold=1.0)(lp.float().cuda(), il.int().cuda())
    assert [h[0].tokens for h in face] == [x[0].tokens.tolist() for x in ctc_beam_search(lp.float(), il, beam_width=10, backend='cpu')]
    from seqdist.decode import ctc_decoder                                 # torchaudio's face: CUDA emissions searched there
    face = ctc_decoder(None, chars, beam_size=6, nbest=2, sil_score=0.3)
    with count_launches() as launches: got = face(lp.float().cuda(), il.cuda())
    assert sum(launches.values()) >= 1, 'the CUDA kernel searched'
    assert ([[(h.tokens.tolist(), h.timesteps.tolist(), h.score) for h in x] for x in got] ==
            [[(h.tokens.tolist(), h.timesteps.tolist(), h.score) for h in x] for x in face(lp.float(), il)])
    record('ctc_beam_search')

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('semiring', ['Log', 'Max'])
def test_gpu_graph_logz_equals_the_cpu_kernel(dtype, semiring, record):
    """graph_logz on CUDA tensors (the CUDA kernel) = the CPU kernel on the same inputs: random graphs with epsilon arcs
    shared by a ragged batch (a length 0; one graph by four sequences, whose arc scores' gradients add four rows), log Z
    and its gradients w.r.t. the emissions and the arc scores (Max: the best path's, exactly in float64); bitwise the
    same on a second run."""
    from seqdist.graph import Graph, graph_logz, random_graph
    g = _gen(5)
    gs = [random_graph(12, 40, 6, generator=_gen(10 + i)) for i in range(3)]
    T, N = 40, 6
    lp = torch.randn(T, N, 6, generator=g, dtype=torch.float64).mul(2).log_softmax(-1).to(dtype)
    il = torch.randint(0, T + 1, (N,), generator=g); il[1] = 0
    def run(device):
        x = lp.to(device).requires_grad_()
        ws = [s.scores.to(device).requires_grad_() for s in gs]
        graphs = [Graph(s.src, s.dst, s.labels, w, s.start, s.finals, s.final_scores.to(device), num_states=s.num_states)
                  for s, w in zip(gs, ws)]
        z = graph_logz(x, il.to(device), [graphs[n % 3 // 2 * 2] for n in range(N)], semiring=semiring)   # (graph 0: four sequences)
        d = torch.autograd.grad(torch.where(torch.isfinite(z), z, 0).sum(), [x, *ws], allow_unused=True)
        return [z.detach().cpu()] + [torch.zeros(t.shape, dtype=t.dtype) if e is None else e.cpu() for e, t in zip(d, [x, *ws])]
    got, again, want = run('cuda'), run('cuda'), run('cpu')
    for a, b in zip(got, again): assert torch.equal(a, b)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    err = _compare(got, want, tol, f"graph_logz {semiring} {dtype}")
    record('graph', ('graph_logz',), err)

@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_gpu_gru_auto_is_cudnn_bit_for_bit(dtype, record):
    """GRU (backend 'auto') on CUDA tensors calls cuDNN as nn.GRU does: the same outputs and gradients bit for bit,
    with lengths (on the CPU: packed) as nn.GRU's packed path gives; its weights are flat (no copy per call, no
    warning); backend='cuda' (our kernels) agrees within rounding."""
    import warnings
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
    from seqdist.gru import GRU
    anchor = torch.nn.GRU(12, 16, num_layers=2, bidirectional=True).cuda().to(dtype)
    ours = GRU(12, 16, num_layers=2, bidirectional=True).cuda().to(dtype)
    ours.load_state_dict(anchor.state_dict())
    x = torch.randn(30, 5, 12, generator=_gen(4)).cuda().to(dtype)
    lengths = torch.tensor([30, 7, 19, 1, 30])
    def run(m, lengths=None, **kw):
        xx = x.clone().requires_grad_()
        if lengths is None or isinstance(m, GRU): y, h = m(xx, None, lengths, **kw) if lengths is not None else m(xx)
        else:
            y, h = m(pack_padded_sequence(xx, lengths, enforce_sorted=False))
            y = pad_packed_sequence(y, total_length=x.shape[0])[0]
        return [y, h] + list(torch.autograd.grad(y.float().sum() + h.float().sum(), [xx, *m.parameters()]))
    with warnings.catch_warnings():
        if dtype == torch.float32: warnings.simplefilter('error')   # (non-flat weights would warn; cuDNN flattens no
        for lens in (None, lengths):                                  # bfloat16 weights, for nn.GRU neither)
            for a, b in zip(run(ours, lens), run(anchor, lens)): assert torch.equal(a, b)
    ours.backend = 'cuda'
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # (cuDNN's float32 RNN takes TF32 by default)
        err = _compare([t.float() for t in run(ours, lengths)], [t.float() for t in run(anchor, lengths)],
                       dict(rtol=5e-2, atol=1e-1) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4), f"GRU cuda {dtype}")
    # (bfloat16: ours computes in float32, cuDNN in bfloat16; the weights' gradients, sums over 150 steps, differ by
    # up to 0.053 on the H200)
    record('gru', ('cudnn',), err)

def _denominator_graph(S, C, extra=3, seed=0):
    """A stand-in for a shared LF-MMI denominator graph of S states: each state a self-loop, an arc to the next state
    and `extra` random arcs, random labels and scores, every state final (so any length has a path)."""
    from seqdist.graph import Graph
    g = _gen(seed)
    v = torch.arange(S)
    src = torch.cat([v, v, v.repeat(extra)])
    dst = torch.cat([v, (v + 1) % S, torch.randint(0, S, (extra * S,), generator=g)])
    labels = torch.randint(0, C, (len(src),), generator=g)
    return Graph(src, dst, labels, torch.randn(len(src), generator=g, dtype=torch.float64), start=0, finals=v,
                 final_scores=torch.zeros(S, dtype=torch.float64))

@pytest.mark.parametrize('semiring', ['Log', 'Max'])
def test_gpu_graph_logz_checkpointed_is_the_every_frame_kernel_and_fits_1gb(semiring, monkeypatch, record):
    """Past CUDA_FORWARD_BYTES the CUDA kernel keeps the forward scores every isqrt(T) + 1 frames and recomputes a segment
    at a time: with the budget at 0, the same bits as every frame kept (random graphs with epsilon arcs, a ragged batch,
    float32); and a graph of 20,000 states shared by N = 32 sequences of T = 500 frames, float32 (every frame kept:
    1.28 GB of forward scores), takes a forward and backward within 1 GB beyond its inputs."""
    import seqdist.graph as G
    from seqdist.graph import graph_logz, random_graph
    gs = [random_graph(12, 40, 6, generator=_gen(20 + i)) for i in range(3)]
    T, N = 40, 6
    lp = torch.randn(T, N, 6, generator=_gen(6), dtype=torch.float64).mul(2).log_softmax(-1).float().cuda()
    il = torch.randint(0, T + 1, (N,), generator=_gen(7)); il[1] = 0
    def run(x, lengths, graphs):
        x = x.detach().requires_grad_()
        z = graph_logz(x, lengths, graphs, semiring=semiring)
        return z.detach(), torch.autograd.grad(torch.where(torch.isfinite(z), z, 0).sum(), x)[0]
    every = run(lp, il.cuda(), [gs[n % 3] for n in range(N)])
    monkeypatch.setattr(G, 'CUDA_FORWARD_BYTES', 0)
    segmented = run(lp, il.cuda(), [gs[n % 3] for n in range(N)])
    assert all(torch.equal(a, b) for a, b in zip(every, segmented))
    monkeypatch.undo()
    T, N, C, S = 500, 32, 32, 20_000
    assert G.cuda_segment_frames(T, N, S, 4) == 23
    den = _denominator_graph(S, C)
    x = torch.randn(T, N, C, generator=_gen(8)).log_softmax(-1).cuda()
    lengths = torch.full((N,), T).cuda()
    run(x, lengths, den)                                             # warm: compiled, the graph's tables cached
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    z, grad = run(x, lengths, den)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(z).all() and torch.isfinite(grad).all()
    assert extra <= 1e9, f"{extra / 1e6:.0f} MB beyond the inputs"
    record('graph', ('graph_logz',), None)

def _transducer_decoding_on(device, count_syncs=False):
    """Greedy (RNN-T, TDT) and beam (with a token LM) decoding of a random transducer whose weights are on `device`:
    each hypothesis as (what, utterance, rank, labels, frames, score), and the greedy decoder's host-device
    synchronisations (counted where `count_syncs`)."""
    import warnings
    from seqdist.decode import transducer_greedy_decode, transducer_beam_search, random_transducer, NGramLM, random_arpa
    B, T, V = 6, 48, 12
    enc = torch.randn(B, T, 16, generator=_gen(8), dtype=torch.float64).to(device)
    lengths = torch.tensor([48, 40, 1, 0, 33, 47]).to(device)
    tokens = [f't{i}' for i in range(V)]
    lm = NGramLM(text=random_arpa(2, tokens[1:], order=2, n_per_order=20))
    out, syncs = [], []
    for kind, extra in (('rnnt', {}), ('tdt', dict(durations=[0, 1, 2, 3]))):
        predict, join = random_transducer(V, seed=3, dtype=torch.float64, blank_bias=3.0, device=device, extra=len(extra.get('durations', ())))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            if count_syncs: torch.cuda.set_sync_debug_mode('warn')
            try: greedy = transducer_greedy_decode(enc, lengths, predict=predict, join=join, blank=0, max_symbols_per_frame=3, **extra)
            finally:
                if count_syncs: torch.cuda.set_sync_debug_mode(0)
        syncs.append(sum('synchroniz' in str(w.message) for w in caught))
        beams = transducer_beam_search(enc, lengths, predict=predict, join=join, blank=0, beam_width=4, nbest=2, max_symbols_per_frame=2,
                                       lm=lm, lm_weight=0.4, tokens=tokens, **extra)
        out += [(kind + ' greedy', b, 0, h.tokens.tolist(), h.timesteps.tolist(), h.score) for b, h in enumerate(greedy)]
        out += [(kind + ' beam', b, r, h.tokens.tolist(), h.timesteps.tolist(), h.score) for b, hs in enumerate(beams) for r, h in enumerate(hs)]
    return out, syncs

def test_gpu_transducer_decoding_equals_the_cpu_and_greedy_reads_the_host_every_16_steps(record):
    """transducer_greedy_decode and transducer_beam_search with the model and encoder output on the GPU (the torch
    path): the CPU's hypotheses (scores within 1e-9: the same float64 model); the greedy decoder reads whether any
    utterance goes on every 16 steps, not at every frame."""
    cpu, _ = _transducer_decoding_on('cpu')
    gpu, syncs = _transducer_decoding_on('cuda', count_syncs=True)
    assert [h[:5] for h in gpu] == [h[:5] for h in cpu]
    assert all(abs(a[5] - b[5]) < 1e-9 for a, b in zip(gpu, cpu))
    assert all(s <= 48 * (3 + 1) // 16 + 8 for s in syncs), syncs       # (at most a step a frame and one a symbol)
    record('transducer_decoding')
