"""Threads and repeats: every family gives bit-identical values and gradients when four Python threads call it at once
(as a data loader's workers, or a server, do), each several times, and on repeated calls: the shared pools (pooled
gradient buffers, cached graphs, the CPU thread pool) never hand one caller another's memory. The shapes are large
enough that the CPU kernels split the batch over threads too (`PARALLEL_MIN`)."""
import threading
import pytest, torch
from seqdist import ctc, rnnt, tdt, joint, ctc_simple, sparse, gru, cross_entropy
from seqdist.crf import CTC_CRF

def _gen(): return torch.Generator().manual_seed(0)

def _with_grads(call, *xs):
    "call(*xs) and the gradients of its sum w.r.t. each x (fresh leaves per call: no state shared between threads)."
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = call(*xs)
    out.sum().backward()
    return [out.detach(), *(x.grad for x in xs)]

def ctc_case():
    g = _gen()
    T, N, C, L = 200, 64, 90, 40
    lp = torch.randn(T, N, C, generator=g).log_softmax(-1)
    y, il, tl = torch.randint(1, C, (N, L), generator=g), torch.full((N,), T), torch.randint(20, L + 1, (N,), generator=g)
    return lp, y, il, tl

def rnnt_case(V=40, extra=0):
    g = _gen()
    B, T, U = 16, 60, 20
    x = torch.randn(B, T, U + 1, V + extra, generator=g)
    y = torch.randint(1, V, (B, U), generator=g, dtype=torch.int32)
    return x, y, torch.full((B,), T, dtype=torch.int32), torch.randint(10, U + 1, (B,), generator=g, dtype=torch.int32)

def crf_case():
    g = _gen()
    crf = CTC_CRF(state_len=3, alphabet='NACGT')
    T, N, L = 300, 16, 60
    return crf, torch.randn(T, N, crf.n_score(), generator=g), torch.randint(1, 5, (N, L), generator=g), torch.full((N,), L)

def ctc_loss():
    lp, y, il, tl = ctc_case()
    return _with_grads(lambda x: ctc.ctc_loss(x, y, il, tl, reduction='none'), lp)

def ctc_entropy():
    lp, y, il, tl = ctc_case()
    return _with_grads(lambda x: ctc.alignment_entropy(x, y, il, tl), lp)

def ctc_forced_align():
    lp, y, il, tl = ctc_case()
    return list(ctc.forced_align(lp.transpose(0, 1), y, il, tl))

def ctc_loss_emulated():
    lp, y, il, tl = ctc_case()
    n = 4                                  # the emulator is slow: a few sequences
    return _with_grads(lambda x: ctc.ctc_loss(x, y[:n], il[:n], tl[:n], reduction='none', backend='cuda'), lp[:, :n])

def rnnt_loss():
    x, y, il, tl = rnnt_case()
    return _with_grads(lambda z: rnnt.rnnt_loss(z, y, il, tl, blank=0, reduction='none'), x)

def rnnt_entropy():
    x, y, il, tl = rnnt_case()
    return _with_grads(lambda z: rnnt.alignment_entropy(z, y, il, tl, blank=0), x)

def rnnt_kbest():
    x, y, il, tl = rnnt_case()
    return list(rnnt.kbest_alignments(x, y, il, tl, blank=0, k=3))

def tdt_loss():
    x, y, il, tl = rnnt_case(extra=5)
    return _with_grads(lambda z: tdt.tdt_loss(z, y, il, tl, blank=0, reduction='none'), x)

def joint_loss():
    g = _gen()
    B, T, U, H, V = 8, 40, 12, 32, 64
    enc, pred, w = torch.randn(B, T, H, generator=g), torch.randn(B, U + 1, H, generator=g), torch.randn(V, H, generator=g)
    y = torch.randint(1, V, (B, U), generator=g)
    il, tl = torch.full((B,), T), torch.full((B,), U)
    return _with_grads(lambda e, p, W: joint.joint_rnnt_loss(e, p, W, y, il, tl, blank=0, reduction='none'), enc, pred, w)

def crf_loss():
    crf, scores, y, tl = crf_case()
    return _with_grads(lambda s: crf.ctc_loss(s, y, tl, reduction='none'), scores)

def crf_entropy():
    crf, scores, _, _ = crf_case()
    return _with_grads(lambda s: crf.entropy(s), scores)

def sparse_logz():
    g = _gen()
    T, N, C, NZ = 100, 16, 256, 5
    Ms = torch.randn(T, N, C, NZ, generator=g)
    idx = torch.stack([torch.randperm(C, generator=g)[:NZ] for _ in range(C)])
    ends = torch.zeros(N, C)
    return _with_grads(lambda m: sparse.logZ(m, idx, ends, ends), Ms)

def stay_move():
    g = _gen()
    T, N, L = 300, 32, 60
    return _with_grads(lambda s, m: ctc_simple.logZ(s, m, torch.full((N,), L)), torch.randn(T, N, L, generator=g),
                       torch.randn(T, N, L - 1, generator=g))

def gru_layer():
    g = _gen()
    T, N, H = 50, 16, 64
    x, h0 = torch.randn(T, N, H, generator=g), torch.zeros(N, H)
    w_ih, w_hh = torch.randn(3 * H, H, generator=g) * 0.1, torch.randn(3 * H, H, generator=g) * 0.1
    return _with_grads(lambda a, wi, wh: gru.gru_layer(a, h0, wi, wh)[0], x, w_ih, w_hh)

def fused_cross_entropy():
    g = _gen()
    x, y = torch.randn(512, 4000, generator=g), torch.randint(0, 4000, (512,), generator=g)
    return _with_grads(lambda z: cross_entropy.cross_entropy(z, y, reduction='none'), x)

def linear_cross_entropy():
    g = _gen()
    h, w, y = torch.randn(256, 64, generator=g), torch.randn(3000, 64, generator=g), torch.randint(0, 3000, (256,), generator=g)
    return _with_grads(lambda a, b: cross_entropy.linear_cross_entropy(a, b, y, reduction='none'), h, w)

FAMILIES = {f.__name__: f for f in (ctc_loss, ctc_entropy, ctc_forced_align, ctc_loss_emulated, rnnt_loss, rnnt_entropy,
                                    rnnt_kbest, tdt_loss, joint_loss, crf_loss, crf_entropy, sparse_logz, stay_move,
                                    gru_layer, fused_cross_entropy, linear_cross_entropy)}

@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_four_threads_at_once_and_repeated_calls_are_bit_identical(family):
    call = FAMILIES[family]
    want = call()
    assert any(isinstance(w, torch.Tensor) and w.numel() for w in want)
    results, errors, start = [[] for _ in range(4)], [], threading.Barrier(4)
    def worker(i):
        try:
            start.wait()                                       # all four in the kernels at once
            for _ in range(3): results[i].append(call())
        except BaseException as e: errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    if errors: raise errors[0]
    for got in [r for rs in results for r in rs] + [call()]:
        for w, x in zip(want, got): assert torch.equal(w, x), f"{family}: a result differs from the first call's"
