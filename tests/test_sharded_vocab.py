"""A vocabulary sharded over a process group: linear_token_stats and linear_cross_entropy with group= (plain tensors,
uneven shards, vocab_start, a DTensor head), a module under FSDP2, and vocab_parallel_cross_entropy with uneven
shards, in 2 and 3 CPU processes on gloo (a spawn costs most of each test's 8-14 s), against the single-process calls
on the whole head: values and every gradient, float64 to 1e-10 and float32; mismatched inputs raise the same error on
every rank (and no rank hangs)."""
import os, tempfile
import pytest, torch
import torch.nn.functional as F
from seqdist.cross_entropy import linear_token_stats, linear_cross_entropy, vocab_parallel_cross_entropy

N, H = 9, 6
BACKEND = 'reference'   # the ranks' one-shard op: PyTorch, so that no spawned process compiles the CPU kernels (about 20 s
                        # on a cold cache); the parent's single-process calls, which they are checked against, run them
OPTS = [dict(), dict(temperature=0.7, softcap=3.0)]

def _data(V, dtype):
    "The same hidden states, head, bias, targets (two ignored) and output weights on every rank and in the parent."
    g = torch.Generator().manual_seed(5)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=g)
    t[2], t[6] = -100, V - 1
    c = torch.randn(2, N, generator=g, dtype=torch.float64)          # the weights of logp and entropy in the loss
    w = torch.rand(V, generator=g, dtype=torch.float64) + 0.5        # class weights
    x = 3 * torch.randn(N, V, generator=g, dtype=torch.float64)      # logits, for vocab_parallel_cross_entropy
    return [v.to(dtype) if v.is_floating_point() else v for v in (h, W, b, t, c, w, x)]

def _stats_and_grads(h, W, b, t, c, **kw):
    lp, ent = linear_token_stats(h, W, t, linear_bias=b, **kw)
    return [lp.detach(), ent.detach()] + list(torch.autograd.grad((c[0] * lp + c[1] * ent).sum(), [h, W, b]))

def _ce_and_grads(h, W, b, t, w, **kw):
    loss = linear_cross_entropy(h, W, t, linear_bias=b, weight=w, z_loss=0.05, **kw)
    return [loss.detach()] + list(torch.autograd.grad(loss, [h, W, b]))

def _error(f):
    try: f()
    except (ValueError, RuntimeError) as e: return f"{type(e).__name__}: {e}"
    return None

class _Head(torch.nn.Module):
    "A projection and an LM head whose loss is a weighted sum of linear_token_stats' outputs (no group: the plain call)."
    def __init__(self, V):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.proj = torch.nn.Parameter(torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5)
        self.head = torch.nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64))

    def forward(self, h, t, c):
        lp, ent = linear_token_stats(torch.tanh(h @ self.proj.T), self.head, t, temperature=0.9, backend=BACKEND)
        return (c[0] * lp + c[1] * ent).sum()

def _fsdp2_loss_and_grad(mesh, V):
    "The loss and the head's gradient of `_Head` wrapped by FSDP2's fully_shard (its parameters DTensors, gathered per call)."
    from torch.distributed.fsdp import fully_shard
    m = _Head(V)
    fully_shard(m, mesh=mesh)
    h, W, b, t, c, w, x = _data(V, torch.float64)
    loss = m(h, t, c)
    loss.backward()
    return [loss.detach(), m.head.grad.full_tensor()]

def _worker(rank, world, sizes, starts, init_file, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    group, V, res = dist.group.WORLD, sum(sizes), {}
    lo = sum(sizes[:rank]) if starts is None else starts[rank]
    for dtype in (torch.float64, torch.float32):
        h, W, b, t, c, w, x = _data(V, dtype)
        mine = lambda v: v[lo:lo + sizes[rank]].clone().requires_grad_()
        for i, kw in enumerate(OPTS):
            res[dtype, 'stats', i] = _stats_and_grads(h.clone().requires_grad_(), mine(W), mine(b), t, c, group=group,
                                                      vocab_start=None if starts is None else lo, backend=BACKEND, **kw)
        for red in ('mean', 'none'):
            hh, Wl, bl = h.clone().requires_grad_(), mine(W), mine(b)
            loss = linear_cross_entropy(hh, Wl, t, linear_bias=bl, weight=w, z_loss=0.05, reduction=red, group=group,
                                        vocab_start=None if starts is None else lo, backend=BACKEND)
            res[dtype, 'ce', red] = [loss.detach()] + list(torch.autograd.grad((loss * c[0] if red == 'none' else loss).sum(), [hh, Wl, bl]))
        xl = x[:, lo:lo + sizes[rank]].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(xl, t, group=group, z_loss=0.05, vocab_start=None if starts is None else lo)
        res[dtype, 'vp'] = [loss.detach(), torch.autograd.grad(loss, xl)[0]]
    if starts is None:                                   # a DTensor head, sharded Shard(0) by torch.distributed.tensor
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor, Shard
        mesh = init_device_mesh('cpu', (world,))
        h, W, b, t, c, w, x = _data(V, torch.float64)
        Wd = distribute_tensor(W, mesh, [Shard(0)]).requires_grad_()
        lp, ent = linear_token_stats(h, Wd, t, backend=BACKEND)
        (c[0] * lp + c[1] * ent).sum().backward()
        res['dtensor'] = [lp.detach(), ent.detach(), Wd.grad.full_tensor()]
        res['fsdp2'] = _fsdp2_loss_and_grad(mesh, V)
    h, W, b, t, c, w, x = _data(V, torch.float64)
    Wl = W[lo:lo + sizes[rank]]
    vs = None if starts is None else lo
    t_bad = t.clone()
    if rank == world - 1: t_bad[0] = (t_bad[0] + 1) % V                   # one rank's targets differ
    res['err_targets'] = _error(lambda: linear_token_stats(h, Wl, t_bad, group=group, vocab_start=vs))
    h_bad = h.clone()
    if rank == 0: h_bad[1, 1] += 1e-9                                      # one rank's hidden states differ
    res['err_hidden'] = _error(lambda: linear_cross_entropy(h_bad, Wl, t, group=group, vocab_start=vs))
    res['err_range'] = _error(lambda: linear_token_stats(h, Wl, torch.full((N,), V), group=group, vocab_start=vs))
    res['err_smoothing'] = _error(lambda: linear_cross_entropy(h, Wl, t, group=group, label_smoothing=0.1, vocab_start=vs))
    res['after_errors'] = linear_token_stats(h, Wl, t, group=group, vocab_start=vs, backend=BACKEND)[0]   # the group still works
    torch.save(res, os.path.join(out_dir, f'rank{rank}.pt'))
    dist.destroy_process_group()

def _run(sizes, starts=None):
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(len(sizes), sizes, starts, os.path.join(d, 'init'), d), nprocs=len(sizes), join=True)
        return [torch.load(os.path.join(d, f'rank{r}.pt'), weights_only=False) for r in range(len(sizes))]

def _close(a, b, dtype, what):
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")

def _check(res, sizes, starts):
    V = sum(sizes)
    for dtype in (torch.float64, torch.float32):
        h, W, b, t, c, w, x = _data(V, dtype)
        req = lambda v: v.clone().requires_grad_()
        for r, out in enumerate(res):
            lo = sum(sizes[:r]) if starts is None else starts[r]
            rows = slice(lo, lo + sizes[r])
            for i, kw in enumerate(OPTS):
                want = _stats_and_grads(req(h), req(W), req(b), t, c, **kw)
                got = out[dtype, 'stats', i]
                for j, name in enumerate(['log_probs', 'entropy', 'd input']):
                    _close(got[j], want[j], dtype, f"rank {r} {dtype} {kw} {name}")
                _close(got[3], want[3][rows], dtype, f"rank {r} {dtype} {kw} d linear_weight (its rows)")
                _close(got[4], want[4][rows], dtype, f"rank {r} {dtype} {kw} d linear_bias (its rows)")
            for red in ('mean', 'none'):
                hh, WW, bb = req(h), req(W), req(b)
                loss = linear_cross_entropy(hh, WW, t, linear_bias=bb, weight=w, z_loss=0.05, reduction=red)
                want = [loss.detach()] + list(torch.autograd.grad((loss * c[0] if red == 'none' else loss).sum(), [hh, WW, bb]))
                got = out[dtype, 'ce', red]
                _close(got[0], want[0], dtype, f"rank {r} {dtype} linear_cross_entropy {red}")
                _close(got[1], want[1], dtype, f"rank {r} {dtype} linear_cross_entropy {red} d input")
                _close(got[2], want[2][rows], dtype, f"rank {r} {dtype} linear_cross_entropy {red} d linear_weight")
                _close(got[3], want[3][rows], dtype, f"rank {r} {dtype} linear_cross_entropy {red} d linear_bias")
            xx = req(x)
            loss = F.cross_entropy(xx, t) + 0.05 * (torch.logsumexp(xx, 1)[t != -100] ** 2).mean()
            _close(out[dtype, 'vp'][0], loss.detach(), dtype, f"rank {r} {dtype} vocab_parallel_cross_entropy")
            _close(out[dtype, 'vp'][1], torch.autograd.grad(loss, xx)[0][:, rows], dtype, f"rank {r} {dtype} vocab_parallel d logits")
    h, W, b, t, c, w, x = _data(V, torch.float64)
    for r, out in enumerate(res):
        assert out['err_targets'] and 'target differs across the ranks' in out['err_targets'], (r, out['err_targets'])
        assert out['err_hidden'] and 'input (the hidden states) differs' in out['err_hidden'], (r, out['err_hidden'])
        assert out['err_range'] and f'[0, {V})' in out['err_range'], (r, out['err_range'])
        assert out['err_smoothing'] and 'label_smoothing' in out['err_smoothing'], (r, out['err_smoothing'])
        _close(out['after_errors'], linear_token_stats(h, W, t)[0], torch.float64, f"rank {r} after the errors")
        if 'fsdp2' in out:                                  # FSDP2 averages the ranks' gradients of the same batch
            m = _Head(V)
            loss = m(h, t, c)
            loss.backward()
            _close(out['fsdp2'][0], loss.detach(), torch.float64, f"rank {r} FSDP2 loss")
            _close(out['fsdp2'][1], m.head.grad, torch.float64, f"rank {r} FSDP2 d head")
        if 'dtensor' in out:
            hh, WW = h, W.clone().requires_grad_()
            lp, ent = linear_token_stats(hh, WW, t)
            (c[0] * lp + c[1] * ent).sum().backward()
            for got, want, name in zip(out['dtensor'], [lp.detach(), ent.detach(), WW.grad], ['log_probs', 'entropy', 'd weight']):
                _close(got, want, torch.float64, f"rank {r} DTensor head {name}")

def test_two_ranks_uneven_shards_a_dtensor_head_and_fsdp2():
    """Two gloo processes with 13 and 8 classes in rank order, a DTensor head (torch.chunk's 11 and 10), and a module
    wrapped by FSDP2's fully_shard that calls linear_token_stats without a group: every output and gradient equals the
    single-process one."""
    _check(_run([13, 8]), [13, 8], None)

def test_three_ranks_placed_by_vocab_start():
    "Three gloo processes with shards of 9, 5 and 9 classes placed out of rank order by vocab_start (rank 0: the last)."
    _check(_run([9, 5, 9], starts=[14, 0, 5]), [9, 5, 9], [14, 0, 5])

def test_group_needs_an_initialised_process_group():
    import torch.distributed as dist
    if dist.is_initialized(): pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match='process group'):
        linear_token_stats(torch.randn(2, 3), torch.randn(4, 3), torch.tensor([0, 1]), group=object())
    with pytest.raises(ValueError, match='vocab_start'):
        linear_token_stats(torch.randn(2, 3), torch.randn(4, 3), torch.tensor([0, 1]), vocab_start=2)
