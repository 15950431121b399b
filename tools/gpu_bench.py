"""The GPU benchmark in one short run (`make gpu-bench-quick`): every row of the GPU issue with its anchors in the same
run (F.ctc_loss native and cuDNN-eligible, seqdist 0.0.3 from .anchors/, cuDNN's GRU, Liger's fused linear
cross-entropy where its wheel was carried), the variants to decide between (each behind its switch: an argument or an
environment variable, named in the row), the lattice questions, the hour of forced alignment, and a kernel profile of
the rows that lose. Written for a GPU machine without network or nbdev: torch, CuPy and numba already there.

    PYTHONPATH=. python3 tools/gpu_bench.py [OUT.json] [--seconds 330] [--profiles FILE] [--device cpu --quick]

It writes OUT.json (default nbs/bench/cuda.json) after every family, so a run cut short keeps what it measured; a
family that raises gives a row saying so and the run goes on; families not reached before --seconds say 'not run'.
`--device cpu --quick` runs the same script on small shapes on the CPU (a smoke test of the script, no figures)."""
import argparse, contextlib, datetime, json, os, sys, time, traceback
from pathlib import Path
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from seqdist.bench import (_families, bench_ctc_gpu, GPU_CTC_SHAPES, compare_row, value_and_grad, load_seqdist003,
                           _sync, ctc_inputs_for, timed_pair)
from seqdist.timing import peak_gpu_mb


def _now(): return datetime.datetime.now(datetime.timezone.utc)


@contextlib.contextmanager
def _env(name, value):
    "The environment variable `name` set to `value` (a variant's switch, read at each call) inside the block, then as before."
    old = os.environ.get(name)
    os.environ[name] = value
    try: yield
    finally:
        if old is None: os.environ.pop(name, None)
        else: os.environ[name] = old


def _liger():
    "Liger's fused linear cross-entropy (liger-kernel, carried as a wheel), or None."
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception: return None
    def f(h, W, t):
        out = liger_fused_linear_cross_entropy(h, W, t)
        return out[0] if isinstance(out, tuple) else getattr(out, 'loss', out)
    return f


def ctc_variant_rows(device, quick):
    """ctc_loss fwd+bwd under each kernel variant (SEQDIST_CTC_VARIANT, SEQDIST_CTC_POSTERIORS, read at each call)
    against seqdist 0.0.3 and F.ctc_loss native, at the GPU issue's shapes: the rows that choose the default."""
    shapes = [(200, 16, 20, 30, 40)] if quick else GPU_CTC_SHAPES
    q = dict(warmup=1, reps=3) if quick else dict(warmup=2, reps=7)
    rows = []
    for variant in ('smem', 'split+smem', 'smem+log2', 'split+smem+log2'):     # ('both', 'split': behind on the H200)
        with _env('SEQDIST_CTC_VARIANT', variant):
            rows += [dict(r, op=f"{r['op']} [SEQDIST_CTC_VARIANT={variant}]") for r in bench_ctc_gpu(shapes, device, **q)
                     if 'cuDNN' not in r['anchor']]
    with _env('SEQDIST_CTC_POSTERIORS', 'warp'):            # the posteriors a warp a frame, with the default recursion
        rows += [dict(r, op=f"{r['op']} [SEQDIST_CTC_POSTERIORS=warp]") for r in bench_ctc_gpu(shapes, device, **q)
                 if 'cuDNN' not in r['anchor']]
    return rows


def sparse_variant_rows(ctc_crf):
    """The ctc_crf family's rows under its variables (read at each call), beside the default's: sparse.logZ and CTC_CRF
    with the recursions unbounded ($SEQDIST_SPARSE_BOUNDS=1; the default bounds float on sm_90 to two blocks an SM);
    every row with float Log's recursions in base 2 ($SEQDIST_SPARSE_LOG2=1 and $SEQDIST_CTC_SIMPLE_LOG2=1, ex2 and lg2
    where the default takes e^x and log1p): the rows that choose the defaults."""
    with _env('SEQDIST_SPARSE_BOUNDS', '1'):
        rows = [dict(r, op=f"{r['op']} [SEQDIST_SPARSE_BOUNDS=1]") for r in ctc_crf() if not r['op'].startswith('ctc_simple')]
    with _env('SEQDIST_SPARSE_LOG2', '1'), _env('SEQDIST_CTC_SIMPLE_LOG2', '1'):
        return rows + [dict(r, op=f"{r['op']} [SEQDIST_*_LOG2=1]") for r in ctc_crf()]


def fused_divergence_rows(family, variable):
    """A questions family's entropy and KL rows with its CUDA kernel fused (`variable`=fused, read at each call: one
    block a sequence, the backward after the forward, the edges' gradients as it goes), beside the default's (split:
    both recursions at once, then the gradients a thread an edge, node or label): the rows that choose the default."""
    with _env(variable, 'fused'):
        return [dict(r, op=f"{r['op']} [{variable}=fused]") for r in family()
                if 'entropy' in r['op'] or 'alignment_kl' in r['op']]


def launch_rows(device, quick):
    """Host time per launch (µs, from 2,000 back-to-back launches of a one-block kernel, then a sync): through
    seqdist's Kernel (argument checks, marshalling, CuPy), CuPy's function called directly with the marshalled
    arguments, and a PyTorch op of the same size; what a tile's or a step's launches cost before any GPU work."""
    import numpy as np
    from seqdist.ctc import _ctc_kernels
    from seqdist.core import Log
    k = _ctc_kernels[(torch.float32, Log)]['ctc_grad']
    lp, grad, g, logz = (torch.zeros(*shape, device=device) for shape in ((4, 8), (4, 8), (1,), (1,)))
    il = torch.full((1,), 4, device=device)
    launch = lambda: k((1,), (32,), lp=lp, minus_posteriors=None, grad_logz=g, logz=logz, input_lengths=il, grad=grad,
                       rows=4, N=1, C=8, torch_grad=1, zero_infinity=0)
    n = 200 if quick else 2000
    def per_launch(fn):
        fn(); _sync(device)
        start = time.perf_counter()
        for _ in range(n): fn()
        _sync(device)
        return (time.perf_counter() - start) / n * 1e6
    rows = [dict(op='one kernel launch, host time', shape='1 block of 32 threads', anchor='-', anchor_ms=float('nan'),
                 ours_ms=per_launch(launch) / 1e3, ratio=float('nan'), check="seqdist Kernel.__call__ (by name)")]
    if torch.device(device).type == 'cuda':
        import cupy
        fn = next(iter(k._compiled.values()))['fn']
        args = (np.uint64(lp.data_ptr()), np.uint64(0), np.uint64(g.data_ptr()), np.uint64(logz.data_ptr()),
                np.uint64(il.data_ptr()), np.uint64(grad.data_ptr()), np.int64(4), np.int32(1), np.int32(8), np.int32(1), np.int32(0))
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        rows.append(dict(rows[0], ours_ms=per_launch(lambda: fn((1,), (32,), args, stream=stream)) / 1e3,
                         check='CuPy Function call, arguments marshalled once'))
    rows.append(dict(rows[0], ours_ms=per_launch(lambda: torch.add(lp, 1, out=grad)) / 1e3, check='torch.add(out=) of the same size'))
    return rows


def linear_ce_rows(device, quick):
    """linear_cross_entropy against the eager composition and Liger (fp32 and bf16 shapes of the issue), its chunk
    sizes as variants; linear_token_stats against its composition; each with both peak memories."""
    import torch.nn.functional as F
    from seqdist.cross_entropy import linear_cross_entropy, linear_token_stats, linear_token_stats_reference
    from seqdist.benchmarks.cross_entropy import _ce_case, _stats_objective
    shapes = [(256, 64, 4096, torch.float32)] if quick else [(4096, 1024, 32768, torch.float32), (8192, 4096, 131072, torch.bfloat16)]
    q = dict(warmup=1, reps=3) if quick else dict(warmup=2, reps=7)
    rows, liger = [], _liger()
    eager = lambda h, W, t: F.cross_entropy((h @ W.T).float(), t)
    for N, H, V, dt in shapes:
        h, W, t = _ce_case(N, V, H, dtype=dt)
        h, W, t = h.detach().to(device).requires_grad_(), W.detach().to(device).requires_grad_(), t.to(device)
        vg = lambda f: (lambda: (lambda l: (l.detach(), torch.autograd.grad(l, (h, W))[0]))(f(h, W, t)))
        shape = f"N={N} H={H} V={V} {str(dt).split('.')[1]}"
        variants = [('default', None)] + ([('chunk_size=1024', 1024), ('chunk_size=2048', 2048)] if dt == torch.float32 else [('chunk_size=2048', 2048)])
        for name, chunk in variants:
            ours = vg(lambda h, W, t, c=chunk: linear_cross_entropy(h, W, t, chunk_size=c))
            op = 'linear_cross_entropy fwd+bwd' + ('' if chunk is None else f' [{name}]')
            rows.append(compare_row(op, shape, '(h @ W.T) then F.cross_entropy (eager)', vg(eager), ours, device, **q))
            if chunk is None:
                rows.append(compare_row(op, shape, 'Liger fused linear cross-entropy 0.8.5', None if liger is None else vg(liger),
                                        ours, device, **q))
        if dt == torch.float32:
            ours = vg(lambda h, W, t: _stats_objective(*linear_token_stats(h, W, t)))
            theirs = vg(lambda h, W, t: _stats_objective(*linear_token_stats_reference(h, W, t)))
            rows.append(compare_row('linear_token_stats fwd+bwd', shape, 'logits, log_softmax, gather, entropy (eager)',
                                    theirs, ours, device, **q))
        del h, W
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def joint_rows(device, quick):
    """joint_rnnt_loss against the composition, fp32 and bf16, with peak memory; the CUDA tile share as variants
    (SEQDIST_JOINT_TILE_SHARE, read at each call)."""
    from seqdist.benchmarks.joint import JOINT_SHAPES, joint_inputs_for, _composition, _fused, _fwd_bwd
    shapes = [(2, 20, 5, 32, 16)] if quick else JOINT_SHAPES
    q = dict(warmup=1, reps=3) if quick else dict(warmup=2, reps=7)
    rows = []
    for dt in (torch.float32, torch.bfloat16):
        for B, T, U, V, H in shapes:
            xs, *args = joint_inputs_for(B, T, U, V, H, device, dtype=dt)
            run = lambda f: (lambda: (lambda l, g: (l, g[0]))(*_fwd_bwd(f, xs, *args)))
            for share in ('default', '4', '8', '32'):
                with _env('SEQDIST_JOINT_TILE_SHARE', share) if share != 'default' else contextlib.nullcontext():
                    op = 'joint_rnnt_loss fwd+bwd' + ('' if share == 'default' else f' [SEQDIST_JOINT_TILE_SHARE={share}]')
                    rows.append(compare_row(op, f"B={B} T={T} U={U} V={V} H={H} {str(dt).split('.')[1]}",
                                            'joiner + rnnt_loss', run(_composition), run(_fused), device, **q))
            del xs
    return rows


def _timed_row(op, shape, anchor, theirs, ours, device, quick, check='-', **more):
    "A row of two calls timed alternately (no gradient): the anchor's time over ours, `theirs` None: none to compare."
    q = dict(warmup=1, reps=3) if quick else dict(warmup=2, reps=7)
    if theirs is None:
        t1 = timed_pair(ours, ours, device, **q)[0]
        return dict(op=op, shape=shape, anchor=anchor, anchor_ms=float('nan'), ours_ms=t1, ratio=float('nan'), check=check, **more)
    t0, t1 = timed_pair(theirs, ours, device, **q)
    return dict(op=op, shape=shape, anchor=anchor, anchor_ms=t0, ours_ms=t1, ratio=t0 / t1, check=check, **more)


def _cuctc():
    "torchaudio's cuda_ctc_decoder (its cuctc extension), or None where it does not load."
    try:
        from torchaudio.models.decoder import cuda_ctc_decoder
        return cuda_ctc_decoder
    except Exception: return None


def decode_rows(device, quick):
    """The decoding issue's GPU rows: `cuda_ctc_decoder`'s face against torchaudio's (cuctc) at its beam, no LM; a
    token 3-gram's cost and 1,000 hotwords' cost against the same search without; a lexicon and a word 3-gram on the
    device against the CPU kernel; transducer greedy decoding (batch 32) against the per-frame loop and beam 4 against
    greedy, the model on the device."""
    import random
    from seqdist.decode import (cuda_ctc_decoder, ctc_beam_search, NGramLM, random_arpa, Hotwords, transducer_greedy_decode,
                                transducer_greedy_reference, transducer_beam_search, random_transducer)
    from seqdist.benchmarks.decode import spoken_emissions
    rows, theirs_face = [], _cuctc()
    N, T = (4, 100) if quick else (32, 400)
    for C in (32, 500):
        g = torch.Generator().manual_seed(C)
        lp = torch.randn(N, T, C, generator=g).mul(3).log_softmax(-1)
        lp[..., 0] += 2.0                                       # blank-heavy, as trained CTC models are
        lp = lp.log_softmax(-1).to(device)
        lengths = torch.randint(3 * T // 4, T + 1, (N,), generator=g).int().to(device)
        vocab = ['<blk>'] + [f'\u2581t{i}' if i % 4 == 0 else f't{i}' for i in range(1, C)]
        ours = cuda_ctc_decoder(vocab, beam_size=10)
        theirs = theirs_face(vocab, beam_size=10) if theirs_face is not None and device == 'cuda' else None
        a, b = ours(lp, lengths), (theirs(lp, lengths) if theirs is not None else None)
        same = '-' if b is None else f"the same best tokens in {sum(x[0].tokens == y[0].tokens for x, y in zip(a, b))} of {N}"
        rows.append(_timed_row('cuda_ctc_decoder, beam 10, no LM', f"N={N} T={T} C={C}",
                               "torchaudio's cuda_ctc_decoder (cuctc)" + ('' if theirs else ' (not loaded)'),
                               (lambda: theirs(lp, lengths)) if theirs else None, lambda: ours(lp, lengths), device, quick, same))
        tokens = ['-'] + vocab[1:]
        lm = NGramLM(text=random_arpa(0, tokens[1:], order=3, n_per_order=2000 if not quick else 50))
        il = lengths.long()
        none = lambda: ctc_beam_search(lp, il, beam_width=10)
        rows.append(_timed_row('ctc_beam_search, a token 3-gram (cost: ratio = no LM / LM)', f"N={N} T={T} C={C} beam 10",
                               'the same search without an LM', none,
                               lambda: ctc_beam_search(lp, il, beam_width=10, tokens=tokens, lm=lm, lm_weight=0.5, lm_tokens=True),
                               device, quick, 'target: LM <= 1.2x no LM, ratio >= 0.83'))
        if C == 32:
            rng = random.Random(0)
            word = lambda: rng.choices(range(1, C), k=rng.randint(3, 6))
            hot = Hotwords.from_arg([(sum((word() for _ in range(rng.randint(2, 3))), []), 1.0) for _ in range(1000)], None, 0, C)
            rows.append(_timed_row('ctc_beam_search, 1,000 hotwords (cost: ratio = none / hotwords)', f"N={N} T={T} C={C} beam 10",
                                   'the same search without hotwords', none, lambda: ctc_beam_search(lp, il, beam_width=10, hotwords=hot),
                                   device, quick))
    lp, chars, lexicon, _ = spoken_emissions(4 if quick else 16, 500)
    from seqdist.decode import word_arpa
    path = '/tmp/seqdist_gpu_bench_words.arpa'
    word_arpa(path, lexicon, *((50_000, 50_000) if not quick else (500, 500)))      # (the CPU bench's 3-gram of 100k n-grams)
    lm = NGramLM(path)
    kw = dict(beam_width=50, tokens=chars, lm=lm, lm_weight=0.5, word_score=1.0, lexicon=lexicon, whole_words=True, lm_lookahead=True,
              semiring='max')
    lpd = lp.to(device)
    rows.append(_timed_row('ctc_beam_search, lexicon + word 3-gram, on the device', f"N={lp.shape[0]} T=500 C={len(chars)} beam 50",
                           'the CPU kernel (2 threads)', lambda: ctc_beam_search(lp, backend='cpu', **kw), lambda: ctc_beam_search(lpd, **kw),
                           device, quick))
    B, T, V, H = (8, 50, 64, 64) if quick else (32, 200, 64, 64)
    enc = torch.randn(B, T, H, generator=torch.Generator().manual_seed(0)).to(device)
    lengths = torch.randint(3 * T // 4, T + 1, (B,), generator=torch.Generator().manual_seed(0)).to(device)
    predict, join = random_transducer(V=V, H=H, blank_bias=4.5, device=device)
    with torch.no_grad():
        greedy = lambda: transducer_greedy_decode(enc, lengths, predict=predict, join=join, blank=0)
        rows.append(_timed_row('transducer_greedy_decode, RNN-T, on the device', f"B={B} T={3 * T // 4}-{T} V={V} H={H}",
                               'the per-frame loop (transducer_greedy_reference)',
                               lambda: transducer_greedy_reference(enc, lengths, predict, join, 0, 10), greedy, device, quick))
        for cap in (10, 2):
            rows.append(_timed_row(f'transducer_beam_search, beam 4, cap {cap}, on the device', f"B={B} T={3 * T // 4}-{T} V={V} H={H}",
                                   'transducer_greedy_decode (target: beam <= 3x greedy, ratio >= 0.33)',
                                   lambda: transducer_greedy_decode(enc, lengths, predict=predict, join=join, blank=0, max_symbols_per_frame=cap),
                                   lambda: transducer_beam_search(enc, lengths, predict=predict, join=join, blank=0, beam_width=4,
                                                                  max_symbols_per_frame=cap), device, quick))
    return rows


def graph_rows(device, quick):
    """The graph lattice's GPU rows: graph_loss over CTC graphs against seqdist's ctc_loss (target: ratio >= 0.5), over
    a 3-mer CTC-CRF graph against sparse.logZ (ratio >= 0.67), the shared denominator (S=20,000, E=250,000, N=32
    T=500: within 50 ms and 1 GB), and GraphLattice's entropy against log Z's forward and backward."""
    from seqdist.ctc import ctc_loss
    from seqdist import sparse
    from seqdist.crf import kmer_transitions
    from seqdist.graph import graph_loss, graph_logz, ctc_graph, sparse_crf_graph, GraphLattice
    from seqdist.benchmarks.graph import denominator_graph
    rows = []
    for N, T, C, L in ([(4, 100, 32, 20)] if quick else [(32, 500, 32, 100), (32, 500, 500, 100)]):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(T, N, C, generator=g).to(device).requires_grad_()
        targets, tl = torch.randint(1, C, (N, L), generator=g), torch.randint(L // 2, L + 1, (N,), generator=g)
        il = torch.full((N,), T)
        graphs = ctc_graph(targets, tl)
        td, ild, tld = targets.to(device), il.to(device), tl.to(device)
        rows.append(compare_row('graph_loss, CTC graphs', f"N={N} T={T} C={C} L={L // 2}-{L}", "seqdist's ctc_loss",
                                value_and_grad(lambda x: ctc_loss(x.log_softmax(-1), td, ild, tld, reduction='none'), logits),
                                value_and_grad(lambda x: graph_loss(x.log_softmax(-1), il, graphs, reduction='none'), logits), device,
                                **(dict(warmup=1, reps=3) if quick else {})))
    N, T, k = (4, 200, 3) if quick else (64, 4000, 3)
    idx = kmer_transitions(k, 4)
    Cn, NZ = idx.shape
    Ms = torch.randn(T, N, Cn, NZ, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    zeros, crf_graph, lengths = torch.zeros(N, Cn, device=device), sparse_crf_graph(idx), torch.full((N,), T)
    idx_d = idx.to(device)
    rows.append(compare_row('graph_logz, CTC-CRF graph', f"N={N} T={T} {k}-mers", "seqdist's sparse.logZ",
                            value_and_grad(lambda x: sparse.logZ(x, idx_d, zeros, zeros), Ms),
                            value_and_grad(lambda x: graph_logz(x.flatten(2), lengths, crf_graph), Ms), device,
                            **(dict(warmup=1, reps=3) if quick else {})))
    N, T, S, E, C = (2, 50, 2000, 25000, 500) if quick else (32, 500, 20000, 250000, 500)
    den = denominator_graph(S, E, C)
    lp = torch.randn(T, N, C, generator=torch.Generator().manual_seed(2)).log_softmax(-1).to(device).requires_grad_()
    lengths = torch.full((N,), T)
    run = value_and_grad(lambda x: graph_logz(x, lengths, den), lp)
    row = compare_row('graph_logz fwd+bwd, a shared denominator graph', f"N={N} T={T} S={S} E={E} C={C}",
                      'none (target: <= 50 ms and 1 GB on an H100)', None, run, device, **(dict(warmup=1, reps=3) if quick else {}))
    rows.append(row)
    N, T, C, L = (4, 100, 32, 20) if quick else (32, 500, 32, 100)
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(T, N, C, generator=g).log_softmax(-1).to(device)
    graphs = ctc_graph(torch.randint(1, C, (N, L), generator=g), torch.randint(L // 2, L + 1, (N,), generator=g))
    il = torch.full((N,), T)
    x = lp.clone().requires_grad_()
    rows.append(_timed_row('GraphLattice entropy (ratio: log Z fwd+bwd / entropy)', f"N={N} T={T} C={C} L={L // 2}-{L}",
                           'graph_logz fwd+bwd', lambda: torch.autograd.grad(graph_logz(x, il, graphs).sum(), x),
                           lambda: GraphLattice(lp, il, graphs).entropy(), device, quick))
    # the walks on the device (the CUDA kernel's Max and sampling passes, 2026-11-29): argmax against the CPU kernel on
    # a host copy (what a GPU ran before), 8 samples against log Z's forward
    rows.append(_timed_row('GraphLattice argmax on the GPU (ratio: the CPU kernel on a host copy / GPU)', f"N={N} T={T} C={C} L={L // 2}-{L}",
                           'GraphLattice(lp.cpu()).argmax', lambda: GraphLattice(lp.cpu(), il, graphs).argmax,
                           lambda: GraphLattice(lp, il, graphs).argmax, device, quick,
                           check=f"the CPU kernel's paths: {torch.equal(GraphLattice(lp.cpu(), il, graphs).argmax, GraphLattice(lp, il, graphs).argmax.cpu())}"))
    with torch.no_grad():
        rows.append(_timed_row('GraphLattice 8 samples (ratio: log Z forward / 8 samples)', f"N={N} T={T} C={C} L={L // 2}-{L}",
                               'graph_logz forward', lambda: graph_logz(lp, il, graphs),
                               lambda: GraphLattice(lp, il, graphs).sample((8,)), device, quick))
    return rows


def align_hour_rows(device, quick):
    "forced_align of an hour of frames (T=180,000, L=50,000, C=32) on the device: time and peak extra memory."
    from seqdist.ctc import forced_align
    T, L, C = (2000, 500, 32) if quick else (180000, 50000, 32)
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(1, T, C, generator=g).log_softmax(-1).to(device)
    targets = torch.randint(1, C, (1, L), generator=g).to(device)
    forced_align(lp[:, :200], targets[:, :50])                        # compile
    times = []
    for _ in range(1 if not quick else 2):
        _sync(device); start = time.perf_counter(); forced_align(lp, targets); _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    mb = peak_gpu_mb(lambda: forced_align(lp, targets), device)
    return [dict(op='forced_align, an hour', shape=f"T={T} L={L} C={C}", anchor='- (measured, no target)',
                 anchor_ms=float('nan'), ours_ms=min(times), ratio=float('nan'), ours_mb=mb, check='-')]


def profiles(device, path, quick):
    "torch.profiler's kernel table (device time) of one warm fwd+bwd of the losing rows, into `path`."
    from torch.profiler import profile, ProfilerActivity
    from seqdist.ctc import ctc_loss
    from seqdist.gru import GRU
    from seqdist.benchmarks.joint import joint_inputs_for, _fused, _fwd_bwd
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == 'cuda' else [])
    cases = []
    for T, N, C, L_min, L_max in (GPU_CTC_SHAPES[:1] if quick else GPU_CTC_SHAPES):
        x, tg, il, tl = ctc_inputs_for(T, N, C, L_min, L_max, device)
        cases.append((f"ctc_loss T={T} N={N} C={C} L={L_min}-{L_max}",
                      lambda x=x, tg=tg, il=il, tl=tl: torch.autograd.grad(ctc_loss(x.log_softmax(2), tg, il, tl), x)))
    xs, *args = joint_inputs_for(*((2, 20, 5, 32, 16) if quick else (4, 200, 50, 1024, 256)), device)
    cases.append(("joint_rnnt_loss B=4 T=200 U=50 V=1024 H=256", lambda: _fwd_bwd(_fused, xs, *args)))
    from seqdist import sparse, ctc_simple
    from seqdist.crf import kmer_transitions
    from seqdist.core import Log
    from seqdist.cross_entropy import cross_entropy
    g = torch.Generator().manual_seed(0)
    T, N, k = (50, 2, 3) if quick else (500, 16, 4)                       # sparse.logZ at the GPU issue's first shape
    Ms = torch.randn(T, N, 4 ** k, 5, generator=g).to(device).requires_grad_()
    idx, v = kmer_transitions(k, 4), torch.zeros(N, 4 ** k, device=device)
    cases.append((f"sparse.logZ T={T} N={N} C={4 ** k}", lambda: torch.autograd.grad(sparse.logZ(Ms, idx, v, v, Log).sum(), Ms)))
    T, N, L = (50, 2, 10) if quick else (800, 64, 160)                     # ctc_simple.logZ
    stay = torch.randn(T, N, L, generator=g).to(device).requires_grad_()
    move = torch.randn(T, N, L - 1, generator=g).to(device)
    lens = torch.full((N,), L, device=device)
    cases.append((f"ctc_simple.logZ T={T} N={N} L={L}", lambda: torch.autograd.grad(ctc_simple.logZ(stay, move, lens).sum(), stay)))
    xc = torch.randn(*((64, 512) if quick else (4096, 32768)), generator=g).to(device).requires_grad_()
    tc = torch.randint(0, xc.shape[1], (xc.shape[0],), generator=g).to(device)
    cases.append((f"cross_entropy N={xc.shape[0]} V={xc.shape[1]}", lambda: torch.autograd.grad(cross_entropy(xc, tc), xc)))
    from seqdist.crf import CTC_CRF                                         # the questions farthest from their targets
    from seqdist.ctc import alignment_entropy
    crf = CTC_CRF(3 if quick else 5, 'NACGT')
    xs_crf = torch.randn(50 if quick else 1000, 2 if quick else 16, crf.n_score(), generator=g).to(device).requires_grad_()
    shape = f"T={xs_crf.shape[0]} N={xs_crf.shape[1]} state_len={crf.state_len}"
    cases += [(f"CTC_CRF.entropy fwd+bwd, the paths, {shape}", lambda: torch.autograd.grad(crf.entropy(xs_crf).sum(), xs_crf)),
              (f"CTC_CRF.sample n=8, the paths, {shape}", lambda: crf.sample(xs_crf.detach(), 8, torch.Generator(device).manual_seed(0))),
              (f"CTC_CRF.kbest k=4, the paths, {shape}", lambda: crf.kbest(xs_crf.detach(), 4))]
    lq, tq, ilq, tlq = ctc_inputs_for(*((50, 2, 8, 5, 10) if quick else (500, 32, 20, 80, 100)), device)
    xq = lq.detach().requires_grad_()
    cases.append((f"CTC alignment_entropy fwd+bwd T={xq.shape[0]} N={xq.shape[1]}",
                  lambda: torch.autograd.grad(alignment_entropy(xq, tq, ilq, tlq, reduction='sum'), xq)))
    gru = GRU(256, 256, backend='cuda').to(device)
    xg = torch.randn(200, 32, 256, device=device, requires_grad=True)
    cases.append(("GRU backend='cuda' T=200 N=32 I=H=256", lambda: torch.autograd.grad(gru(xg)[0].sum(), [xg, *gru.parameters()])))
    with open(path, 'w') as f:
        for name, fn in cases:
            try:
                fn(); fn(); _sync(device)
                with profile(activities=acts) as prof:
                    fn(); _sync(device)
                key = 'self_cuda_time_total' if len(acts) > 1 else 'self_cpu_time_total'
                f.write(f"== {name}\n{prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60)}\n")
            except Exception: f.write(f"== {name}\nFAILED\n{traceback.format_exc()}\n")
            f.flush()


def host_profile(device, path, quick):
    """cProfile of 20 warm ctc_loss fwd+bwd calls (T=500 N=128 C=20 L=80-100, the GPU's first shape), synchronised
    once at the end: where the host's time goes (the GPU's kernels took under half the wall time there)."""
    import cProfile, pstats, io
    from seqdist.ctc import ctc_loss
    x, tg, il, tl = ctc_inputs_for(*((100, 8, 20, 10, 20) if quick else GPU_CTC_SHAPES[0]), device)
    step = lambda: torch.autograd.grad(ctc_loss(x.log_softmax(2), tg, il, tl), x)
    for _ in range(3): step()
    _sync(device)
    prof = cProfile.Profile()
    start = time.perf_counter(); prof.enable()
    for _ in range(20): step()
    prof.disable(); host = time.perf_counter() - start
    _sync(device); wall = time.perf_counter() - start
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats('tottime').print_stats(35)
    Path(path).write_text(f"20 calls: host {host * 1e3:.1f} ms, wall {wall * 1e3:.1f} ms (profiled)\n" + out.getvalue())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', nargs='?', default='nbs/bench/cuda.json')
    p.add_argument('--seconds', type=float, default=330, help="stop starting families after this long")
    p.add_argument('--profiles', help="write the kernel profiles of the losing rows here")
    p.add_argument('--device', default='cuda')
    p.add_argument('--quick', action='store_true', help="small shapes (a smoke test of this script)")
    p.add_argument('--only', help="comma-separated families to run (e.g. ctc,joint,host), not all")
    a = p.parse_args()
    torch.set_num_threads(2)
    start, deadline, dev = _now(), time.time() + a.seconds, a.device
    name = torch.cuda.get_device_name() if dev == 'cuda' else 'CPU (smoke test)'
    cuda = torch.version.cuda or '-'
    head = dict(date='', machine=f"one {name}", torch=f"{torch.__version__.split('+')[0]} (CUDA {cuda})", threads=2,
                command='make gpu-bench-quick (tools/gpu_bench.py)', seqdist003=load_seqdist003() is not None,
                liger=_liger() is not None, rows=[], errors=[], not_run=[], seconds={})
    fams = dict(_families(a.quick, dev, gpu=True))
    fams.pop('cross_entropy', None); fams.pop('joint', None)
    order = [('ctc', fams['ctc']), ('ctc_variants', lambda: ctc_variant_rows(dev, a.quick)), ('ctc_crf', fams['ctc_crf']),
             ('ctc_crf_variants', lambda: sparse_variant_rows(fams['ctc_crf'])), ('launch', lambda: launch_rows(dev, a.quick)), ('gru', fams['gru']),
             ('joint', lambda: joint_rows(dev, a.quick)), ('linear_cross_entropy', lambda: linear_ce_rows(dev, a.quick)),
             ('cross_entropy', lambda: __import__('seqdist.benchmarks.cross_entropy', fromlist=['x']).bench_cross_entropy(
                 quick=a.quick, ce_shapes=[(4096, 32768), (8192, 131072)], lce_shapes=[], stats_shapes=[], device=dev)),
             ('ctc_questions', fams['ctc_questions']),
             ('ctc_questions_variants', lambda: fused_divergence_rows(fams['ctc_questions'], 'SEQDIST_CTC_DIVERGENCE')),
             ('forced_align', fams['forced_align']),
             ('rnnt', fams['rnnt']), ('rnnt_questions', fams['rnnt_questions']),
             ('rnnt_questions_variants', lambda: fused_divergence_rows(fams['rnnt_questions'], 'SEQDIST_RNNT_DIVERGENCE')), ('tdt', fams['tdt']),
             ('tdt_questions', fams['tdt_questions']),
             ('tdt_questions_variants', lambda: fused_divergence_rows(fams['tdt_questions'], 'SEQDIST_TDT_DIVERGENCE')),
             ('crf_questions', fams['crf_questions']),
             ('crf_questions_variants', lambda: fused_divergence_rows(fams['crf_questions'], 'SEQDIST_CRF_DIVERGENCE')),
             ('beam_search', fams['beam_search']), ('align_hour', lambda: align_hour_rows(dev, a.quick)),
             ('decode', lambda: decode_rows(dev, a.quick)), ('graph', lambda: graph_rows(dev, a.quick))]
    if a.profiles: order.insert([n for n, _ in order].index('cross_entropy'), ('profiles', lambda: profiles(dev, a.profiles, a.quick) or []))
    if a.profiles: order.append(('host', lambda: host_profile(dev, a.profiles.replace('.txt', '_host.txt'), a.quick) or []))
    if a.only:
        unknown = set(a.only.split(',')) - {n for n, _ in order}
        if unknown: raise SystemExit(f"--only: no families {sorted(unknown)} (there are {[n for n, _ in order]})")
        order = [f for f in order if f[0] in a.only.split(',')]
    for name, bench in order:
        if time.time() > deadline: head['not_run'].append(name); continue
        t = time.time()
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            for r in bench(): head['rows'].append(dict(r, family=name))
        except Exception:
            head['errors'].append(dict(family=name, error=traceback.format_exc()[-2000:]))
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        head['seconds'][name] = round(time.time() - t, 1)
        head['date'] = f"{start:%Y-%m-%d %H:%M}-{_now():%H:%M} UTC"
        Path(a.out).write_text(json.dumps(head, indent=1, default=float) + '\n')
        print(f"   {name}: {head['seconds'][name]} s", file=sys.stderr, flush=True)
    for r in head['rows']:
        ratio = r.get('ratio')
        print(f"{r['op'][:58]:58} {r['shape'][:42]:42} {r['anchor'][:40]:40} "
              f"{'-' if ratio is None or ratio != ratio else f'{ratio:.2f}x'}  {r.get('ours_ms', float('nan')):.3f} ms")


if __name__ == '__main__':
    main()
