"""What a call costs the host on the CUDA path, measured without a GPU: each family's forward and backward run through
the emulator with its inputs treated as a GPU's (`on_host` false in every module, so lengths and labels are checked
by device assertions, as on a GPU) and backend 'auto' taken as 'cuda'. Per call: the PyTorch ops (and those of them
that launch a kernel on a GPU: not views, not allocations), seqdist's kernel launches, and the host time with the
emulated kernels' time taken out (median of rounds, one thread). On a GPU each launching op and each launch costs host
time between kernels, so these counts are what the small shapes' GPU figures were made of (the GPU issue's profile).

    PYTHONPATH=. python tools/host_cost.py [--json FILE] [--rounds 7] [--calls 30]

Not a GPU measurement: a GPU's host pays more per launch than this CPU pays per op."""
import argparse, collections, json, os, statistics, sys, time
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')    # (the emulator's threads must not spin on the cores the host uses)
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NEEDED = {'ctc_prepare'}     # kernels whose outputs later ops index with: run (emulated) in the timing rounds too

# ops that launch nothing on a GPU: views, metadata, allocations
_NO_LAUNCH = {'aten.' + n for n in ('detach', 'view', '_unsafe_view', 'select', 'unsqueeze', 'squeeze', 'expand', 'alias',
              'slice', 'permute', 't', 'transpose', 'as_strided', 'empty', 'new_empty', 'empty_like', 'empty_strided',
              'unbind', 'split', 'reshape', 'movedim', 'narrow', '_local_scalar_dense', 'lift_fresh')}

class _Count(TorchDispatchMode):
    def __init__(self): super().__init__(); self.ops = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

def _as_on_a_gpu():
    "Every seqdist module's `on_host` answers False and `resolve_backend` takes 'auto' as 'cuda'; the emulator's time is kept apart."
    import seqdist, seqdist.kernel, seqdist.utils
    seqdist.utils.package_kernels()                      # (imports every module)
    spent, stub = [0.0], [False]
    launch = seqdist.kernel._launch_emulator
    def timed(kernel, *a):                               # timing rounds: only the kernels whose outputs the host's ops
        if stub[0] and kernel.name not in _NEEDED: return # index with run (an emulated kernel leaves the CPU's caches
        t = time.perf_counter()                          # and threads in a state that slows the host's next ops 4x)
        try: return launch(kernel, *a)
        finally: spent[0] += time.perf_counter() - t
    seqdist.kernel._launch_emulator = timed
    from seqdist import ops, core
    resolve, question = ops.resolve_backend, core.question_backend
    def on_cuda(backend, *a, **kw): return resolve('cuda' if backend == 'auto' else backend, *a, **kw)
    def question_on_cuda(backend, x, what, name='log_probs', cuda=False):
        return question('cuda' if backend == 'auto' and cuda else backend, x, what, name, cuda)
    for name, m in list(sys.modules.items()):
        if name.startswith('seqdist'):
            if hasattr(m, 'on_host'): m.on_host = lambda *xs: False
            if getattr(m, 'resolve_backend', None) is resolve: m.resolve_backend = on_cuda
            if getattr(m, 'question_backend', None) is question: m.question_backend = question_on_cuda
    return spent, stub

def _calls():
    "name -> (shape, a forward and backward on CPU tensors)."
    from seqdist.ctc import ctc_loss, alignment_entropy
    from seqdist.cross_entropy import cross_entropy
    from seqdist.rnnt import rnnt_loss
    from seqdist.crf import CTC_CRF
    g = torch.Generator().manual_seed(0)
    T, N, C, L = 50, 8, 20, 10
    x = torch.randn(T, N, C, generator=g).requires_grad_()
    tg, il, tl = torch.randint(1, C, (N, L), generator=g), torch.full((N,), T), torch.full((N,), L)
    logits = torch.randn(64, 100, generator=g).requires_grad_()
    y = torch.randint(0, 100, (64,), generator=g)
    B, Tr, U, V = 4, 20, 6, 12
    r = torch.randn(B, Tr, U + 1, V, generator=g).requires_grad_()
    ry, rl, rul = torch.randint(1, V, (B, U), generator=g, dtype=torch.int32), torch.full((B,), Tr, dtype=torch.int32), torch.full((B,), U, dtype=torch.int32)
    crf = CTC_CRF(3, 'NACGT')
    s = torch.randn(60, 4, crf.n_score(), generator=g).requires_grad_()
    ct, cl = torch.randint(1, 5, (4, 12), generator=g), torch.randint(9, 13, (4,), generator=g)
    from seqdist.joint import joint_rnnt_loss
    from seqdist import ctc_simple
    sst, smv = torch.randn(T, N, L, generator=g).requires_grad_(), torch.randn(T, N, L - 1, generator=g).requires_grad_()
    sl = torch.randint(L // 2, L + 1, (N,), generator=g)
    H = 16
    je, jp = torch.randn(B, Tr, H, generator=g).requires_grad_(), torch.randn(B, U + 1, H, generator=g).requires_grad_()
    jW, jb = torch.randn(V, H, generator=g).requires_grad_(), torch.randn(V, generator=g).requires_grad_()
    tile = B * Tr * (U + 1) * V * 4 // 8                 # 8 tiles, as JOINT_CUDA_TILE_SHARE makes on a GPU
    return {'ctc_loss (log_softmax, mean)': (f"T={T} N={N} C={C} L={L}", lambda: ctc_loss(x.log_softmax(2), tg, il, tl).backward()),
            'alignment_entropy (sum)': (f"T={T} N={N} C={C} L={L}", lambda: alignment_entropy(x.log_softmax(2), tg, il, tl).sum().backward()),
            'cross_entropy (mean)': ("N=64 C=100", lambda: cross_entropy(logits, y).backward()),
            'rnnt_loss (mean)': (f"B={B} T={Tr} U={U} V={V}", lambda: rnnt_loss(r, ry, rl, rul, blank=0).backward()),
            'CTC_CRF.ctc_loss': ("T=60 N=4 state_len=3", lambda: crf.ctc_loss(s, ct, cl).backward()),
            'ctc_simple.logZ': (f"T={T} N={N} L={L}", lambda: ctc_simple.logZ(sst, smv, sl).sum().backward()),
            'joint_rnnt_loss (8 tiles)': (f"B={B} T={Tr} U={U} V={V} H={H}", lambda: joint_rnnt_loss(
                je, jp, jW, ry, rl, rul, bias=jb, blank=0, tile_bytes=tile).backward())}

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--json', help="write the rows here"); p.add_argument('--rounds', type=int, default=7)
    p.add_argument('--calls', type=int, default=30)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    spent, stub = _as_on_a_gpu()
    from seqdist.kernel import count_launches
    rows = []
    for name, (shape, call) in _calls().items():
        for _ in range(3): call()                        # warm: kernels built, tables cached
        with _Count() as c, count_launches() as k: call()
        times, stub[0] = [], True
        for _ in range(3): call()
        for _ in range(a.rounds):
            spent[0], t = 0.0, time.perf_counter()
            for _ in range(a.calls): call()
            times.append((time.perf_counter() - t - spent[0]) / a.calls * 1e6)
        stub[0] = False
        launching = sum(v for op, v in c.ops.items() if op not in _NO_LAUNCH)
        rows.append(dict(call=name, shape=shape, ops=sum(c.ops.values()), launching_ops=launching,
                         launches=sum(k.values()), kernels=dict(k), host_us=round(statistics.median(times), 1)))
        print(f"{name:32} {shape:24} {rows[-1]['ops']:4} ops ({launching:3} launching)  {rows[-1]['launches']:2} launches  "
              f"{rows[-1]['host_us']:7.1f} us host")
    if a.json:
        with open(a.json, 'w') as f:
            json.dump(dict(date=time.strftime('%Y-%m-%d'), torch=torch.__version__, threads=1, rows=rows), f, indent=1)
    return rows

if __name__ == '__main__': main()
