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

def test_ctc_loss_agrees_with_pytorch_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    T, N, C = 100, 8, 20
    lp = torch.randn(T, N, C, generator=g).log_softmax(2).cuda()
    targets = torch.randint(1, C, (N, 30), generator=g).cuda()
    il, tl = torch.full((N,), T).cuda(), torch.randint(10, 31, (N,), generator=g).cuda()
    (l1, g1), (l2, g2) = [_grad(lambda x: ctc_loss(x, targets, il, tl), lp) for _ in range(2)]
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    lt, gt = _grad(lambda x: F.ctc_loss(x, targets.cpu(), il.cpu(), tl.cpu()), lp.cpu().double())
    torch.testing.assert_close(l1.cpu().double(), lt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g1.cpu().double(), gt, rtol=1e-4, atol=1e-5)
