"""seqdist.koi.decode (koi.decode's beam_search and to_str, the CPU and the CUDA kernel) against brute force: on tiny
lattices, every path enumerated and grouped by hypothesis (its state after frame 0 and the bases of its later moves);
the beam search's best hypothesis, with a beam that keeps them all and no cut, is the group of highest log-sum-exp, and
its qualities come from the enumerated state posteriors; narrower beams never beat it; the CUDA kernel's outputs are the
CPU kernel's; the outputs' invariants; inputs left unmodified; fp16; bad inputs; to_str; install_as_koi."""
import itertools, math, sys
from collections import defaultdict
import numpy as np
import pytest, torch
import seqdist.koi as seqdist_koi
from seqdist.koi import decode

BLANK = 2.0

def hypotheses_count(C, T):
    "Hypotheses after the last frame: C first states times the base strings of length <= T - 1."
    return C * sum(4 ** i for i in range(T))

def enumerate_paths(M, blank):
    """Every path of one read's lattice (move scores M (T, C, 4)): {(first state, bases): [path scores]} and the state
    posteriors (T + 1, C) (state after t frames)."""
    T, C, _ = M.shape
    groups, paths = defaultdict(list), []
    for z0 in range(C):
        for edges in itertools.product(range(5), repeat=T):        # 0: stay, 1 + b: the move shifting in base b
            z, score, states, bases = z0, 0.0, [z0], []
            for t, e in enumerate(edges):
                if e == 0: score += blank
                else:
                    c = (z * 4 + e - 1) % C
                    score += M[t, c, z // (C // 4)]; z = c       # entered from its predecessor z = j * C // 4 + c // 4
                    if t > 0: bases.append(e - 1)
                states.append(z)
            groups[(states[1], tuple(bases))].append(score)
            paths.append((score, states))
    scores = np.array([p[0] for p in paths])
    logZ = np.logaddexp.reduce(scores)
    post = np.zeros((T + 1, C))
    for (score, states) in paths:
        post[np.arange(T + 1), states] += math.exp(score - logZ)
    return {k: float(np.logaddexp.reduce(v)) for k, v in groups.items()}, post

def expected_quality(post, first, bases, moves, scale=1.0, offset=0.0):
    "The phred characters of the hypothesis (first, bases) aligned by `moves` (T,), from the posteriors (T + 1, C)."
    C = post.shape[1]
    state, p, frames = first, [], []
    it = iter(bases)
    for t, m in enumerate(moves):
        if t > 0 and m: state = (state * 4 + next(it)) % C; p.append([])
        elif t == 0: p.append([])
        p[-1].append(post[t + 1, state])
    q = [min(50, max(1, round(scale * -10 * math.log10(max(1 - float(np.mean(x)), 1e-300)) + offset))) for x in p]
    return ''.join(chr(33 + v) for v in q)

def rows(x): return [decode.to_str(r) for r in x]

@pytest.mark.parametrize('state_len, T', [(1, 5), (2, 4), (1, 1), (2, 2)])
@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_wide_beam_finds_the_brute_force_maximum(backend, state_len, T):
    "(backend 'cuda': the CUDA kernel, emulated on these CPU tensors.)"
    C = 4 ** state_len
    scores = torch.randn(2, T, 4 * C, dtype=torch.float64, generator=torch.Generator().manual_seed(state_len))
    width = hypotheses_count(C, T)
    seq, qs, moves, best = decode.beam_search(scores, beam_width=width, beam_cut=math.inf, return_scores=True, backend=backend)
    for n in range(2):
        groups, post = enumerate_paths(scores[n].reshape(T, C, 4).numpy(), BLANK)
        assert len(groups) == width
        (first, bases), top = max(groups.items(), key=lambda kv: kv[1])
        assert abs(float(best[n]) - top) < 1e-9, (float(best[n]), top)
        assert decode.to_str(seq[n]) == 'ACGT'[first % 4] + ''.join('ACGT'[b] for b in bases)
        assert decode.to_str(qs[n]) == expected_quality(post, first, bases, moves[n].tolist())
        _, q2, m2 = decode.beam_search(scores[n:n + 1], beam_width=width, beam_cut=math.inf, scale=1.5, offset=-2.0,
                                       backend=backend)
        assert torch.equal(m2[0], moves[n]) and decode.to_str(q2[0]) == expected_quality(post, first, bases, moves[n].tolist(), 1.5, -2.0)
        # narrower beams (and a cut) never beat it; the score they return sums the alignments that survived pruning,
        # so it is at most the full log-sum-exp of the sequence they return
        for w, cut in ((1, 100.0), (3, 100.0), (16, 10.0), (64, math.inf)):
            s, _, m, b = decode.beam_search(scores[n:n + 1], beam_width=w, beam_cut=cut, return_scores=True, backend=backend)
            assert float(b[0]) <= top + 1e-9
            string = decode.to_str(s[0])
            matches = [v for (f, bs), v in groups.items() if 'ACGT'[f % 4] + ''.join('ACGT'[x] for x in bs) == string]
            assert matches and any(float(b[0]) <= v + 1e-9 for v in matches)

def test_invariants_unmodified_input_and_dtypes():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 40, 256, generator=g) * 2                # state_len 3
    copy = scores.clone()
    seq, qs, moves = decode.beam_search(scores)
    assert torch.equal(scores, copy)
    assert all(x.dtype == torch.int8 and x.shape == (3, 40) for x in (seq, qs, moves))
    assert (moves[:, 0] == 1).all() and set(moves.unique().tolist()) <= {0, 1}
    assert torch.equal(seq != 0, moves == 1) and torch.equal(qs != 0, moves == 1)
    assert set(seq[moves == 1].tolist()) <= set(b'ACGT')
    assert qs[moves == 1].min() >= ord('"') and qs[moves == 1].max() <= ord('S')
    for dtype in (torch.float16, torch.float64, torch.bfloat16):      # computed in float64: same decode (fp16's rounding aside)
        s, q, m = decode.beam_search(scores.to(dtype))
        if dtype == torch.float64: assert torch.equal(s, seq) and torch.equal(q, qs) and torch.equal(m, moves)
        else: assert torch.equal(m[:, 0], moves[:, 0]) and (m == 1).any()
    # scale and offset act on the phred values; the batch is decoded read by read
    _, q2, _ = decode.beam_search(scores, scale=0.5, offset=3.0)
    assert torch.equal(q2 != 0, moves == 1)
    one = decode.beam_search(scores[1:2])
    assert all(torch.equal(a[0], b[1]) for a, b in zip(one, (seq, qs, moves)))
    # a view (non-contiguous) decodes as its copy
    view = scores.transpose(0, 1).contiguous().transpose(0, 1)
    assert all(torch.equal(a, b) for a, b in zip(decode.beam_search(view), (seq, qs, moves)))

@pytest.mark.parametrize('state_len', [1, 2, 3])
def test_cuda_kernel_is_the_cpu_kernel(state_len):
    """The CUDA beam search (emulated on CPU tensors) keeps the CPU kernel's hypotheses: the same sequences, qualities,
    moves and best scores, bit for bit, at beams of 1 to 64 with and without a cut, reads of several lengths' worth of
    frames, from float16, float32 and float64 scores."""
    g = torch.Generator().manual_seed(10 + state_len)
    x = 2 * torch.randn(3, 9, 4 ** (state_len + 1), generator=g)
    x[1] = x[0] + 1e-3 * torch.randn(9, 4 ** (state_len + 1), generator=g)   # near-equal reads: near-equal hypotheses
    for dtype in (torch.float16, torch.float32, torch.float64):
        for w, cut in ((1, 100.0), (4, 100.0), (32, 5.0), (64, math.inf)):
            cpu, cuda = (decode.beam_search(x.to(dtype), w, cut, return_scores=True, backend=b) for b in ('cpu', 'cuda'))
            assert all(torch.equal(a, b) for a, b in zip(cpu, cuda)), (dtype, w, cut)

def test_a_clear_read_decodes_to_its_bases():
    g = torch.Generator().manual_seed(3)
    k, C = 2, 16
    truth = torch.randint(0, 4, (15,), generator=g).tolist()
    scores = torch.randn(1, 3 * (len(truth) - k + 1), 4 * C, generator=g) - 3
    state = truth[0] * 4 + truth[1]
    for i, b in enumerate(truth[k:]):
        new = (state * 4 + b) % C
        scores[0, 3 * (i + 1), new * 4 + state // 4] += 8; state = new
    seq, qs, moves = decode.beam_search(scores)
    assert decode.to_str(seq[0]) == ''.join('ACGT'[b] for b in truth[k - 1:])
    assert moves[0].nonzero()[:, 0].tolist() == [0] + [3 * (i + 1) for i in range(len(truth) - k)]
    assert min(decode.to_str(qs[0])[1:]) >= '+'                      # confident bases: phred >= 10

def test_to_str():
    x = torch.tensor([65, 0, 67, 0, 0, 71, 84], dtype=torch.int8)
    assert decode.to_str(x) == 'ACGT' and decode.to_str(torch.zeros(3, dtype=torch.int8)) == ''
    assert decode.to_str(torch.tensor(list(b'"#S'), dtype=torch.int8)) == '"#S'

def bad_cases():
    s = torch.randn(2, 5, 16)
    return [
        ('2-D', lambda: decode.beam_search(s[0]), ValueError, 'scores'),
        ('width', lambda: decode.beam_search(s[:, :, :12]), ValueError, 'last dimension'),
        ('width 4', lambda: decode.beam_search(s[:, :, :4]), ValueError, 'last dimension'),
        ('T = 0', lambda: decode.beam_search(s[:, :0]), ValueError, 'frame'),
        ('int', lambda: decode.beam_search(s.long()), TypeError, 'scores'),
        ('nan', lambda: decode.beam_search(torch.where(s > 1, float('nan'), s)), ValueError, 'finite'),
        ('inf', lambda: decode.beam_search(torch.where(s > 1, -float('inf'), s)), ValueError, 'finite'),
        ('beam_width 0', lambda: decode.beam_search(s, beam_width=0), ValueError, 'beam_width'),
        ('beam_width big', lambda: decode.beam_search(s, beam_width=decode.MAX_BEAM_WIDTH + 1), ValueError, 'beam_width'),
        ('beam_width float', lambda: decode.beam_search(s, beam_width=2.0), ValueError, 'beam_width'),
        ('beam_cut 0', lambda: decode.beam_search(s, beam_cut=0.0), ValueError, 'beam_cut'),
        ('scale nan', lambda: decode.beam_search(s, scale=float('nan')), ValueError, 'scale'),
        ('blank inf', lambda: decode.beam_search(s, blank_score=math.inf), ValueError, 'blank_score'),
        ('move_pad', lambda: decode.beam_search(s, move_pad=None), ValueError, 'move_pad'),
        ('hp probs', lambda: decode.beam_search(s, return_hp_probs=True), NotImplementedError, 'return_hp_probs'),
        ('backend', lambda: decode.beam_search(s, backend='gpu'), ValueError, 'backend'),
    ]

@pytest.mark.parametrize('case', bad_cases(), ids=lambda c: c[0])
def test_bad_inputs(case):
    _, call, error, match = case
    with pytest.raises(error, match=match): call()

def test_install_as_koi_gives_seqdists_decode_and_lstm(monkeypatch):
    for name in ('koi', 'koi.ctc', 'koi.lstm', 'koi.decode'): monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        import koi as ont_koi              # ONT's koi, where installed, keeps its own CUDA decode
        pytest.skip(f"ONT's koi is installed ({ont_koi.__file__})")
    except (ImportError, OSError):
        pass
    try:
        seqdist_koi.install_as_koi()
        from koi.decode import beam_search, to_str
        assert beam_search is decode.beam_search and to_str is decode.to_str and seqdist_koi.decode is decode
        import koi.lstm as lstm
        from koi.lstm import update_graph             # seqdist's (tests/test_koi_lstm.py checks it)
        assert lstm is seqdist_koi.lstm and update_graph is seqdist_koi.lstm.update_graph
    finally:
        for name in ('koi', 'koi.ctc', 'koi.lstm', 'koi.decode'): sys.modules.pop(name, None)

@pytest.mark.gpu
def test_gpu_scores_decode_on_the_gpu_as_on_the_cpu():
    """Scores on a GPU (bonito's fp16 or fp32) decode there (the CUDA kernel, the guide from CTC_CRF's CUDA forward and
    backward scores) as their CPU copy does: the same sequences, qualities and moves (random scores leave no near-ties
    for the last bits of a GPU's exp and log1p to break), the best scores to 1e-9; inputs unmodified, results on the
    scores' device. (Not sync-free: the input check reads whether every score is finite.)"""
    scores = 2 * torch.randn(8, 200, 1024, generator=torch.Generator().manual_seed(5))     # state_len 4
    for dtype in (torch.float16, torch.float32):
        x = scores.to(dtype).cuda()
        copy = x.clone()
        out = decode.beam_search(x, return_scores=True)
        assert all(o.device == x.device for o in out) and torch.equal(x, copy)
        cpu = decode.beam_search(x.cpu(), return_scores=True)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(out[:3], cpu[:3]))
        torch.testing.assert_close(out[3].cpu(), cpu[3], rtol=1e-9, atol=1e-9)
        assert decode.to_str(out[0][0]) == decode.to_str(cpu[0][0])

def test_bench_rows_at_a_tiny_shape():
    "bench_beam_search (seqdist-bench's decoding rows) runs and reports a decode of every chunk."
    from seqdist.benchmarks.koi_decode import bench_beam_search
    (row,) = bench_beam_search([(3, 40, 2)], beam_width=4, warmup=0, reps=1)
    assert row['shape'] == 'N=3 T=40 state_len=2 float16' and row['ours_ms'] > 0 and row['anchor_ms'] > 0
    assert 'chunks/s' in row['check'] and row['ratio'] == row['anchor_ms'] / row['ours_ms']
