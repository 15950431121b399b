"""Forced alignment at any length: the checkpointed CPU kernel against the one-pass kernel and torchaudio, token spans
against torchaudio's merge_tokens, and a long alignment's memory in a subprocess."""
import json, subprocess, sys
import pytest, torch
import seqdist.ctc as ctc
from seqdist.ctc import forced_align, token_spans, merge_tokens, TokenSpan

def random_case(g, N, T, C, L, blank=0, ties=False, dtype=torch.float32):
    "A batch with variable lengths, repeated labels, a length-0 and a length-1 target, targets that fit their frames."
    lp = torch.randn(N, T, C, generator=g, dtype=dtype)
    if ties: lp = torch.randint(-2, 1, (N, T, C), generator=g).to(dtype)   # few distinct values: many equal paths
    lp = lp.log_softmax(-1)
    labels = torch.tensor([c for c in range(C) if c != blank])
    targets = labels[torch.randint(0, C - 1, (N, L), generator=g)]
    targets[:, 1::3] = targets[:, 0::3][:, :targets[:, 1::3].shape[1]]    # adjacent repeats
    tl = torch.randint(0, L + 1, (N,), generator=g)
    tl[0], tl[-1] = 0, min(1, L)
    il = torch.randint(T // 2, T + 1, (N,), generator=g)
    il = torch.maximum(il, 2 * tl).clamp(max=T)                           # L labels and their repeats fit 2L frames
    return lp, targets, il, tl

def both_paths(monkeypatch, every, *args, **kw):
    "forced_align by the one-pass kernel, then by the checkpointed one with a row kept every `every` frames."
    monkeypatch.setattr(ctc, '_FULL_TABLE_BYTES', 1 << 62)
    one_pass = forced_align(*args, **kw)
    monkeypatch.setattr(ctc, '_FULL_TABLE_BYTES', 0)
    monkeypatch.setattr(ctc, '_CHECKPOINT_EVERY', every)
    return one_pass, forced_align(*args, **kw)

def on_cuda_and_cpu(monkeypatch, tile, every, *args, **kw):
    """forced_align on the CPU, then by the CUDA kernel (emulated on CPU tensors) with blocks of `tile` states and
    back-pointers for every frame (every=None), or segments of `every` frames (0: sqrt(8 T)) from checkpoints."""
    monkeypatch.setattr(ctc, '_VITERBI_TILE', tile)
    monkeypatch.setattr(ctc, '_CUDA_FULL_TABLE_BYTES', 1 << 62 if every is None else 0)
    monkeypatch.setattr(ctc, '_CHECKPOINT_EVERY', every or 0)
    return forced_align(*args, backend='cpu', **kw), forced_align(*args, backend='cuda', **kw)

@pytest.mark.parametrize('every', [0, 1, 2, 3, 7, 1000])   # 0: sqrt(8 T); 1000: one segment
@pytest.mark.parametrize('seed', range(3))
def test_checkpointed_path_is_the_one_pass_path(seed, every, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    for blank, ties, dtype in [(0, False, torch.float32), (3, True, torch.float64), (4, False, torch.float64)]:
        T = int(torch.randint(30, 90, (1,), generator=g))            # rarely a multiple of the interval
        lp, targets, il, tl = random_case(g, 6, T, 5, 12, blank, ties, dtype)
        (l1, s1), (l2, s2) = both_paths(monkeypatch, every, lp, targets, il, tl, blank)
        assert torch.equal(l1, l2) and torch.equal(s1, s2), (blank, ties, dtype, T)

def two_ways(kernel, monkeypatch, every, *args):
    "The one-pass CPU kernel and the checkpointed one (kernel='cpu'), or the CPU and the CUDA kernel in blocks of 32 states."
    return both_paths(monkeypatch, every, *args) if kernel == 'cpu' else on_cuda_and_cpu(monkeypatch, 32, every, *args)

@pytest.mark.parametrize('kernel', ['cpu', 'cuda'])
def test_short_and_degenerate_sequences(kernel, monkeypatch):
    "T = 1, T = 2, empty targets, one label filling every frame, a target that needs exactly its frames."
    g = torch.Generator().manual_seed(5)
    lp = torch.randn(6, 4, 6, generator=g).log_softmax(-1)
    targets = torch.tensor([[1, 2, 2], [3, 0, 0], [1, 0, 0], [2, 2, 0], [1, 2, 3], [5, 5, 5]])
    il, tl = torch.tensor([1, 2, 4, 3, 3, 0]), torch.tensor([0, 1, 1, 2, 3, 0])
    for every in (0, 1, 2):
        (l1, s1), (l2, s2) = two_ways(kernel, monkeypatch, every, lp, targets, il, tl)
        assert torch.equal(l1, l2) and torch.equal(s1, s2)
    assert l2[4, :3].tolist() == [1, 2, 3] and l2[3, :3].tolist() == [2, 0, 2]

@pytest.mark.parametrize('kernel', ['cpu', 'cuda'])
def test_emissions_of_minus_infinity_as_before(kernel, monkeypatch):
    """A label that no frame can emit leaves no finite path: both kernels give the blank path, as today, and no crash
    (on CUDA: a target of 5 blocks, from checkpoints)."""
    g = torch.Generator().manual_seed(6)
    lp = torch.randn(2, 300, 6, generator=g).log_softmax(-1)
    lp[0, :, 4] = -float('inf')
    targets = torch.randint(1, 6, (2, 80), generator=g)
    targets[0, 40] = 4
    (l1, s1), (l2, s2) = two_ways(kernel, monkeypatch, 0, lp, targets)
    assert torch.equal(l1, l2) and torch.equal(s1, s2) and (l2[0] == 0).all()

@pytest.mark.parametrize('tile, every', [(2048, None), (32, None), (32, 1), (32, 5), (64, 9), (32, 0), (2048, 4)])
def test_cuda_kernel_across_blocks_and_checkpoints(tile, every, monkeypatch):
    """The CUDA Viterbi with targets split across up to 7 blocks of `tile` states, and from checkpoints: the CPU's
    paths and scores, among equal paths too (float32 and float64, variable lengths, empty and one-label targets)."""
    g = torch.Generator().manual_seed(tile + (every or 0))
    for blank, ties, dtype in [(0, False, torch.float32), (3, True, torch.float64)]:
        T = int(torch.randint(200, 260, (1,), generator=g))
        lp, targets, il, tl = random_case(g, 5, T, 6, 100, blank, ties, dtype)
        (l1, s1), (l2, s2) = on_cuda_and_cpu(monkeypatch, tile, every, lp, targets, il, tl, blank)
        assert ctc._viterbi_launch_plan(T, 5, 201)[3] == (7 if tile == 32 else 4 if tile == 64 else 1)
        assert torch.equal(l1, l2) and torch.equal(s1, s2), (blank, ties, dtype, T)

def test_cuda_memory_plan():
    """The buffers `_viterbi_states_cuda` allocates: an hour (T = 180,000, L = 50,000) in under 1 GB (a back-pointer a
    cell would be 18 GB), and at T = 20,000, L = 6,000 under a tenth of the back-pointer table of the one-pass kernel."""
    def extra_bytes(T, L, N=1):
        S = 2 * L + 1
        k, segments, tile, tiles = ctc._viterbi_launch_plan(T, N, S)
        return k * N * S + 8 * (segments - 1) * N * S + 16 * N * tiles * k * max(1, segments - 1) + 4 * (segments + 1) * (1 + N * tiles + N)
    assert extra_bytes(180_000, 50_000) < 1e9 and 180_000 * 100_001 > 18e9
    assert extra_bytes(20_000, 6_000) < 20_000 * 12_001 / 10
    assert ctc._viterbi_launch_plan(200, 4, 101)[:2] == (199, 1)       # short: back-pointers for every frame, one launch

@pytest.mark.torchaudio
@pytest.mark.parametrize('seed', range(3))
def test_checkpointed_path_equals_torchaudio(seed, monkeypatch):
    from seqdist.timing import load_torchaudio
    fa = load_torchaudio().functional.forced_align
    monkeypatch.setattr(ctc, '_FULL_TABLE_BYTES', 0)
    g = torch.Generator().manual_seed(seed)
    for blank in (0, 2):                # scores without exact ties: with them torchaudio may pick another path
        lp, targets, il, tl = random_case(g, 5, 157, 7, 40, blank)
        tl = tl.clamp(min=1)                                    # torchaudio refuses empty targets
        labels, scores = forced_align(lp, targets, il, tl, blank)
        for n in range(5):
            ref_labels, ref_scores = fa(lp[n:n+1, :il[n]], targets[n:n+1, :tl[n]].int(), blank=blank)
            assert torch.equal(labels[n, :il[n]], ref_labels[0].long()), (seed, blank, n)
            assert torch.equal(scores[n, :il[n]], ref_scores[0])

def spans_of(labels, scores, blank):
    return [(s.token, s.start, s.end, s.score) for s in merge_tokens(labels, scores, blank)]

@pytest.mark.torchaudio
@pytest.mark.parametrize('seed', range(3))
def test_merge_tokens_and_token_spans_equal_torchaudio(seed):
    from seqdist.timing import load_torchaudio
    ta_merge = load_torchaudio().functional.merge_tokens
    g = torch.Generator().manual_seed(seed)
    for blank, dtype in [(0, torch.float32), (3, torch.float64)]:
        lp, targets, il, tl = random_case(g, 6, 120, 6, 30, blank, dtype=dtype)
        labels, scores = forced_align(lp, targets, il, tl, blank)
        start, end, score = token_spans(labels, scores, tl, blank)
        assert start.shape == (6, int(tl.max())) and score.dtype == dtype
        for n in range(6):
            ours = merge_tokens(labels[n], scores[n], blank)
            ref = ta_merge(labels[n], scores[n], blank)
            assert [(s.token, s.start, s.end) for s in ours] == [(s.token, s.start, s.end) for s in ref]
            assert all(len(s) == len(r) for s, r in zip(ours, ref)) and all(isinstance(s, TokenSpan) for s in ours)
            torch.testing.assert_close(torch.tensor([s.score for s in ours]), torch.tensor([s.score for s in ref]),
                                       rtol=1e-6, atol=1e-7)
            k = int(tl[n])
            assert [s.token for s in ours] == targets[n, :k].tolist()
            assert start[n, :k].tolist() == [s.start for s in ours] and end[n, :k].tolist() == [s.end for s in ours]
            torch.testing.assert_close(score[n, :k], torch.tensor([s.score for s in ours], dtype=dtype))
            assert (start[n, k:] == -1).all() and (end[n, k:] == -1).all() and score[n, k:].isnan().all()

def test_token_spans_edges():
    "No frames, blanks only, max_length shorter and longer than the targets, a list of lengths, bad shapes."
    labels = torch.tensor([[1, 1, 0, 2, 0, 2], [0, 0, 0, 0, 0, 0]])
    scores = torch.arange(12.).reshape(2, 6)
    start, end, score = token_spans(labels, scores, [3, 0], max_length=4)
    assert start.tolist() == [[0, 3, 5, -1], [-1] * 4] and end.tolist() == [[2, 4, 6, -1], [-1] * 4]
    assert score[0, :3].tolist() == [0.5, 3.0, 5.0] and score[0, 3:].isnan().all() and score[1].isnan().all()
    start, _, _ = token_spans(labels, scores, torch.tensor([3, 0]), max_length=2)
    assert start.tolist() == [[0, 3], [-1, -1]]
    start, end, score = token_spans(labels[:, :0], scores[:, :0], [0, 2])
    assert start.shape == (2, 2) and (start == -1).all() and score.isnan().all()
    assert merge_tokens(labels[0, :0], scores[0, :0]) == [] and merge_tokens(labels[1], scores[1]) == []
    with pytest.raises(ValueError, match="same length"): merge_tokens(labels[0], scores[0, :3])
    with pytest.raises(ValueError, match="must be 1D"): merge_tokens(labels, scores)
    with pytest.raises(ValueError, match=r"\(N, T\)"): token_spans(labels[0], scores[0], [3])

def test_token_spans_read_no_values_on_the_host():
    "On the meta device any host read of a value fails: with max_length given, token_spans never reads one."
    labels = torch.tensor([[1, 1, 0, 2, 0, 2]], device='meta')
    start, end, score = token_spans(labels, torch.empty(1, 6, device='meta'), torch.empty(1, dtype=torch.long,
                                    device='meta'), max_length=3)
    assert start.shape == end.shape == score.shape == (1, 3)

LONG = """
import json, resource, sys, time, torch
import seqdist.ctc as ctc
T, L, C = {T}, {L}, 32
g = torch.Generator().manual_seed(0)
lp = torch.randn(1, T, C, generator=g).log_softmax(-1)
targets = torch.randint(1, C, (1, L), generator=g)
ctc.forced_align(lp[:, :500], targets[:, :100])              # compiles (or loads) the kernels
def rss(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) * 1024
open('/proc/self/clear_refs', 'w').write('5')               # the peak (VmHWM) starts again from here
before = rss('VmRSS')
t = time.perf_counter()
labels, scores = ctc.forced_align(lp, targets)
seconds = time.perf_counter() - t
path = labels[0]
starts = (path != 0) & torch.cat([torch.ones(1, dtype=torch.bool), path[1:] != path[:-1]])   # a label begins
print(json.dumps(dict(extra=rss('VmHWM') - before, seconds=seconds, collapses_to_targets=torch.equal(path[starts], targets[0]))))
"""

def test_a_long_alignment_in_bounded_memory():
    """T = 30,000 frames, L = 8,000 labels: the one-pass tables would take 4.3 GB; the checkpointed kernel keeps
    2 S sqrt(8 T) = 16 MB. Run in a subprocess (a crash fails the test; its peak RSS is its own)."""
    code = LONG.format(T=30000, L=8000)
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out['extra'] < 100e6, out
    assert out['collapses_to_targets'], out

def test_an_infeasible_long_alignment_raises():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(2, 30000, 32, generator=g).log_softmax(-1)
    targets = torch.randint(1, 32, (2, 20000), generator=g)
    targets[1, 1::2] = targets[1, 0::2]                      # 10,000 repeats: 30,000 frames needed, 29,999 given
    with pytest.raises(ValueError, match=r"sequence 1 has 20000 target labels"):
        forced_align(lp, targets, torch.tensor([30000, 29999]))

@pytest.mark.gpu
def test_gpu_token_spans_agree_with_cpu_without_a_host_sync():
    "token_spans on CUDA tensors (forced_align's outputs moved there): the CPU's spans, and no host-device sync."
    g = torch.Generator().manual_seed(0)
    lp, targets, il, tl = random_case(g, 8, 300, 9, 60)
    labels, scores = forced_align(lp, targets, il, tl)
    want = token_spans(labels, scores, tl)
    args = [x.cuda() for x in (labels, scores, tl)]
    token_spans(*args, max_length=targets.shape[1])                     # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try: got = token_spans(*args, max_length=targets.shape[1])
    finally: torch.cuda.set_sync_debug_mode(0)
    k = want[0].shape[1]
    assert torch.equal(got[0][:, :k].cpu(), want[0]) and torch.equal(got[1][:, :k].cpu(), want[1])
    torch.testing.assert_close(got[2][:, :k].cpu(), want[2], equal_nan=True, rtol=1e-6, atol=1e-6)
    assert (got[0][:, k:] == -1).all()

@pytest.mark.gpu
def test_gpu_long_alignments_across_blocks_from_checkpoints():
    """On a GPU: T = 20,000, L = 6,000 (12,001 states: 6 blocks; checkpointed) gives the CPU's path and scores; the
    hour, T = 180,000, L = 50,000 (49 blocks, 151 segments), collapses to its targets in under 1 GB of peak extra GPU
    memory."""
    g = torch.Generator().manual_seed(0)
    lp, targets = torch.randn(1, 20_000, 32, generator=g).log_softmax(-1), torch.randint(1, 32, (1, 6_000), generator=g)
    assert ctc._viterbi_launch_plan(20_000, 1, 12_001)[1:] == (51, 2048, 6)
    labels, scores = forced_align(lp, targets)
    gpu_labels, gpu_scores = forced_align(lp.cuda(), targets.cuda())
    assert torch.equal(gpu_labels.cpu(), labels) and torch.equal(gpu_scores.cpu(), scores)
    T, L = 180_000, 50_000
    lp, targets = torch.randn(1, T, 32, device='cuda').log_softmax(-1), torch.randint(1, 32, (1, L), device='cuda')
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
    path = forced_align(lp, targets)[0][0]
    extra = torch.cuda.max_memory_allocated() - before
    starts = (path != 0) & torch.cat([torch.ones(1, dtype=torch.bool, device='cuda'), path[1:] != path[:-1]])
    assert torch.equal(path[starts], targets[0]) and extra < 1e9, extra

def test_forced_align_of_empty_targets_is_all_blank_on_every_backend():
    lp = torch.randn(2, 5, 4, dtype=torch.float64).log_softmax(-1)
    for backend in ('cpu', 'cuda', 'reference'):         # (the CUDA kernel through the emulator)
        labels, scores = forced_align(lp, torch.zeros(2, 0, dtype=torch.long), backend=backend)
        assert (labels == 0).all() and torch.allclose(scores, lp[..., 0])
