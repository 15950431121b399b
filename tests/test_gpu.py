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
    z_cpu, g_cpu = _grad(lambda x: sparse.logZ(x, crf.idx, v.cpu(), v.cpu(), Log, K=1).sum(), Ms.cpu().double())
    torch.testing.assert_close(z.cpu().double(), z_cpu, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(g.cpu().double(), g_cpu, rtol=1e-4, atol=1e-4)

def test_ctc_crf_gradients_are_bitwise_reproducible_and_agree_with_the_cpu():
    crf, scores, targets, lengths = crf_inputs(T=200, N=8, state_len=5)
    f = lambda x: crf.ctc_loss(x, targets.cuda(), lengths.cuda())
    (l1, g1), (l2, g2) = _grad(f, scores), _grad(f, scores)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    lc, gc = _grad(lambda x: crf.ctc_loss(x, targets, lengths), scores.cpu().double())
    torch.testing.assert_close(l1.cpu().double(), lc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g1.cpu().double(), gc, rtol=1e-4, atol=1e-5)

@pytest.mark.parametrize('C', [20, 1000])     # 1000: more classes than states, the states-to-labels kernel
def test_ctc_loss_agrees_with_pytorch_and_is_deterministic(C):
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
