"""Launch and synchronisation budgets of the GPU glue, counted on CPU through the emulator (the same Python glue and
kernels as on a GPU). On a GPU at training shapes the host decides who wins (the GPU issue's profile): every kernel
launch, PyTorch op and host read of a tensor value (`.item()`, `int(t)`, `bool(t)`: a host-device synchronisation when
the tensor is on the GPU) costs time between launches. These tests hold each op to its budget so that the overhead
cannot creep back unseen; lower a budget when you lower the count."""
import collections, pytest, torch
from types import SimpleNamespace
from torch.utils._python_dispatch import TorchDispatchMode
from seqdist.utils import count_launches
from seqdist.ctc import ctc_op, ctc_inputs
from seqdist import sparse, ctc_simple
from seqdist.crf import kmer_transitions

class CountOps(TorchDispatchMode):
    "PyTorch ops called (by name) inside the block; `host_reads` counts reads of a tensor's value by the host."
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))
    @property
    def host_reads(self): return self.ops['aten._local_scalar_dense.default']
    @property
    def total(self): return sum(self.ops.values())

def budget(fn):
    fn()                                            # warm: per-argument data is made once (tensor_cached)
    with count_launches() as launches, CountOps() as ops: fn()
    return launches, ops

@pytest.mark.parametrize('variant', ['', 'both', 'split', 'smem', 'split+smem', 'smem+log2', 'split+smem+log2'])
def test_ctc_budget(variant, monkeypatch):
    "Each recursion variant (SEQDIST_CTC_VARIANT; '' the default) launches alike: split's two blocks a sequence are one launch."
    monkeypatch.setenv('SEQDIST_CTC_VARIANT', variant)
    torch.manual_seed(0)
    T, N, C = 20, 3, 6
    lp, tg, il, tl, _ = ctc_inputs(torch.randn(T, N, C).log_softmax(2), torch.randint(1, C, (N, 5)), torch.full((N,), T),
                                   torch.tensor([5, 3, 4]))
    launches, ops = budget(lambda: ctc_op.compute(lp, tg, il, tl, 0, False, 'labels', False, False, False, 0.0, backend='cuda'))
    assert launches == {'ctc_prepare': 1, 'ctc_alpha_beta': 1, 'ctc_posteriors': 1}
    assert ops.total <= 24 + ('split' in variant), ops.ops   # (split: beta's buffer besides; lengths and labels on the
                                                             # CPU are checked there: host reads, no GPU wait)

def test_ctc_with_lengths_on_the_gpu_reads_nothing_on_the_host(monkeypatch):
    "Tensors that `on_host` calls GPU-resident are checked by the device (torch._assert_async): no host read at all."
    import seqdist.ctc as ctc
    monkeypatch.setattr(ctc, 'on_host', lambda *xs: False)
    torch.manual_seed(0)
    T, N, C = 20, 3, 6
    lp, tg, il, tl, _ = ctc_inputs(torch.randn(T, N, C).log_softmax(2), torch.randint(1, C, (N, 5)), torch.full((N,), T),
                                   torch.tensor([5, 3, 4]))
    compute = lambda lp, tg, il, tl, backend: ctc_op.compute(lp, tg, il, tl, 0, False, 'labels', False, False, False, 0.0, backend=backend)
    expected = compute(lp, tg, il, tl, 'cpu')
    launches, ops = budget(lambda: compute(lp, tg, il, tl, 'cuda'))
    assert ops.host_reads == 0, ops.ops
    for a, b in zip(compute(lp, tg, il, tl, 'cuda'), expected): torch.testing.assert_close(a, b)
    for bad, message in ((dict(il=il + 1), "input_lengths out of"), (dict(tl=tl - 4), "negative target_lengths"),
                         (dict(tl=tl + 1), "longer than the padded targets"), (dict(tg=tg * 0), "equal to blank")):
        args = dict(lp=lp, tg=tg, il=il, tl=tl) | bad
        with pytest.raises(RuntimeError, match=message):       # on a GPU: a device-side assertion, at the next sync
            compute(args['lp'], args['tg'], args['il'], args['tl'], 'cuda')

@pytest.mark.parametrize('on_device', [False, True])
@pytest.mark.parametrize('concatenated', [False, True])
def test_ctc_prepare_is_padded_targets_then_interleave_blanks(concatenated, on_device, monkeypatch):
    """The CUDA backend's one launch (`extended_targets_cuda`: `ctc_prepare`) gives what the CPU backend's ops give
    (`interleave_blanks(padded_targets(...))`), padding of garbage labels replaced by the blank, for padded and
    concatenated targets, lengths and labels on the host or (`on_host` False) on the device, also widened to a
    padded width (the state posteriors'); lengths on the host go to the device in one copy, unchanged."""
    import seqdist.ctc as ctc
    if on_device: monkeypatch.setattr(ctc, 'on_host', lambda *xs: False)
    torch.manual_seed(0)
    T, N, C, S = 12, 5, 7, 8
    lp = torch.randn(T, N, C).log_softmax(2)
    tl = torch.tensor([6, 0, 3, 5, 1])
    padded = torch.randint(0, C - 1, (N, S))                          # (blank C - 1)
    padded[torch.arange(S)[None] >= tl[:, None]] = -7                   # garbage in the padding: not read
    tg = torch.cat([padded[n, :tl[n]] for n in range(N)]) if concatenated else padded
    il = torch.tensor([12, 9, 0, 11, 12])
    for width in (0, 9):
        ext, il_d, tl_d, links = ctc.extended_targets_cuda(lp, tg, il, tl, C - 1, True, width, links=True)
        want = ctc.interleave_blanks(ctc.padded_targets(lp, tg, il, tl, C - 1), C - 1)
        want = torch.nn.functional.pad(want, (0, ext.shape[1] - want.shape[1]), value=C - 1)
        assert ext.shape[1] == 2 * max(width, S if on_device and not concatenated else int(tl.max())) + 1   # (device: no max read)
        assert torch.equal(ext, want) and torch.equal(il_d, il) and torch.equal(tl_d, tl)
        for n in range(N):                        # each label state's first and next state of the same label
            states = [2 * u + 1 for u in range(int(tl[n]))]
            for s in range(ext.shape[1]):
                same = [q for q in states if ext[n, q] == ext[n, s]] if s in states else [s]
                later = [q for q in same if q > s]
                assert links[n, s].tolist() == [same[0], later[0] if later else -1], (n, s)

@pytest.mark.parametrize('concatenated', [False, True])
def test_ctc_prepare_asserts_each_bad_value_on_the_device(concatenated, monkeypatch):
    """Lengths and labels on the device (`on_host` False) are checked by `ctc_prepare` as it reads them, and each
    check asserted by name (on a GPU: a device-side assertion, at the next synchronisation; no host read), the checks
    the CPU makes on host values: input_lengths in [0, T], target_lengths >= 0 and within the padded width or summing
    to the concatenated targets, labels in [0, C) and not the blank."""
    import seqdist.ctc as ctc
    from seqdist.checks import count_checks
    monkeypatch.setattr(ctc, 'on_host', lambda *xs: False)
    torch.manual_seed(0)
    T, N, C = 20, 3, 6
    lp = torch.randn(T, N, C).log_softmax(2)
    tg, il, tl = torch.randint(1, C, (N, 5)), torch.full((N,), T), torch.tensor([5, 3, 4])
    def call(tg, il, tl):
        tg = torch.cat([tg[n, :max(int(tl[n]), 0)] for n in range(N)]) if concatenated else tg
        return ctc.extended_targets_cuda(lp, tg, il, tl, 0)
    with count_checks() as checks: call(tg, il, tl)
    assert sum(checks.values()) == 4 and all(v == 1 for v in checks.values()), checks
    bad_labels = tg.clone(); bad_labels[1, 2] = C
    cases = [(dict(il=il.clone().index_fill_(0, torch.tensor([2]), T + 1)), "input_lengths out of"),
             (dict(il=il.clone().index_fill_(0, torch.tensor([0]), -1)), "input_lengths out of"),
             (dict(tg=bad_labels), "labels out of range"), (dict(tg=tg * 0), "equal to blank")]
    cases += [(dict(tl=tl - 4), "negative target_lengths")] if not concatenated else []
    cases += [(dict(tl=tl + 1), "longer than the padded targets")] if not concatenated else []
    for bad, message in cases:
        args = dict(tg=tg, il=il, tl=tl) | bad
        with pytest.raises(RuntimeError, match=message): call(**args)
    if concatenated:                                                  # one label more than the lengths sum to
        with pytest.raises(RuntimeError, match="do not sum"):
            ctc.extended_targets_cuda(lp, torch.cat([tg[n, :int(tl[n])] for n in range(N)] + [tg[0, :1]]), il, tl, 0)
    else:                                                             # padded targets of width 0: no label to read
        ext = ctc.extended_targets_cuda(lp, tg[:, :0], il, tl * 0, 0)[0]
        assert torch.equal(ext, torch.zeros(N, 1, dtype=torch.long))
        with pytest.raises(RuntimeError, match="longer than the padded targets"):
            ctc.extended_targets_cuda(lp, tg[:, :0], il, tl, 0)

def test_sparse_budget_no_host_reads_once_warm():
    torch.manual_seed(0)
    idx = kmer_transitions(2, 4)
    Ms, v = torch.randn(5, 3, 16, 5), torch.zeros(3, 16)
    op = sparse.sparse_logz
    def forward_backward():          # the op's prepare, forward and backward, as one eager fwd+bwd call runs them
        st = op.prepare(SimpleNamespace(Ms=Ms, idx=idx, v0=v, vT=v, semiring='Log', for_backward=True, K=1), 'cuda', True)
        outs = op.forward['cuda'](st)
        return op.backward['cuda'](st, outs, (torch.ones(3), None, None, None))
    launches, ops = budget(forward_backward)
    assert launches == {'sparse_fwd_bwd': 1, 'sparse_posteriors': 1}
    assert ops.host_reads == 0 and ops.total <= 26, ops.ops      # idx is checked and transposed once, then cached (+1: a CPU idx is compared with the copy checked); 4 of the
    # ops are views (alpha and beta out of the one (2, T+1, N, C) buffer that the fused launch writes)

def test_ctc_simple_budget():
    torch.manual_seed(0)
    stay, move, lengths = torch.randn(6, 3, 5), torch.randn(6, 3, 4), torch.tensor([5, 3, 4])
    launches, ops = budget(lambda: ctc_simple.stay_move_logz.compute(stay, move, lengths, 'Log', True, backend='cuda'))
    assert launches == {'simple_alpha_beta': 1, 'simple_posteriors': 1}
    assert ops.host_reads <= 1 and ops.total <= 22, ops.ops     # 1 read: the range check of CPU target_lengths

def test_rnnt_and_cross_entropy_check_gpu_values_on_the_device(monkeypatch):
    "Lengths, labels and class targets that live on a GPU are checked there: no host read, a bad value still raises."
    import seqdist.rnnt as rnnt, seqdist.cross_entropy as ce
    monkeypatch.setattr(rnnt, 'on_host', lambda *xs: False)
    monkeypatch.setattr(ce, 'on_host', lambda *xs: False)
    logits = torch.randn(2, 5, 4, 6)
    targets, ll, tl = torch.tensor([[1, 2, 3], [4, 5, 1]]), torch.tensor([5, 4]), torch.tensor([3, 2])
    with CountOps() as ops: rnnt.clean_targets(logits, targets, ll, tl, 0)
    assert ops.host_reads == 0, ops.ops
    for bad, message in ((dict(ll=ll + 1), "logit_lengths out of"), (dict(tl=tl + 1), "target_lengths out of"),
                         (dict(targets=targets * 0), "equal to blank")):
        a = dict(targets=targets, ll=ll, tl=tl) | bad
        with pytest.raises(RuntimeError, match=message): rnnt.clean_targets(logits, a['targets'], a['ll'], a['tl'], 0)
    x, t = torch.randn(4, 7), torch.tensor([1, -100, 6, 0])
    with CountOps() as ops: ce._check_targets(t, 7, -100)
    assert ops.host_reads == 0, ops.ops
    with pytest.raises(RuntimeError, match="target class index out of range"): ce._check_targets(t + 1, 7, -100)

@pytest.mark.parametrize('reduction', ['mean', 'sum', 'none'])
def test_cross_entropy_on_the_device_checks_targets_in_its_kernel(reduction, monkeypatch):
    """Targets on the device (`on_host` False) are checked by `ce_forward` as it reads them: one check, asserted on
    the kernel's flag (no PyTorch op over the targets), a bad class still raises by name; the gradient of a reduction
    (expanded: one value for every row) is read as it is, not copied out to the rows: no copy, the CPU kernel's
    gradient. Targets on the host are read there, as before."""
    import seqdist.cross_entropy as ce
    from seqdist.checks import count_checks
    torch.manual_seed(0)
    x, t = torch.randn(6, 7, dtype=torch.float64), torch.tensor([1, -100, 6, 0, 3, 3])
    want = torch.autograd.grad(ce.cross_entropy(x.requires_grad_(), t, reduction=reduction, backend='cpu').sum(), x)[0]
    monkeypatch.setattr(ce, 'on_host', lambda *xs: False)
    with count_checks() as checks, CountOps() as ops:
        loss = ce.cross_entropy(x, t, reduction=reduction, backend='cuda')
        got = torch.autograd.grad(loss.sum(), x)[0]
    assert dict(checks) == {"target class index out of range": 1} and ops.host_reads == 0, (checks, ops.ops)
    assert not any(op.startswith(('aten.lt', 'aten.ge', 'aten.any', 'aten.clone')) for op in ops.ops), ops.ops
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    for bad in (7, -1):
        with pytest.raises(RuntimeError, match="target class index out of range"):
            ce.cross_entropy(x, t.clone().index_fill_(0, torch.tensor([2]), bad), reduction=reduction, backend='cuda')

def test_forced_align_budget():
    """ctc_loss's launch that builds the extended labels (`ctc_prepare`), then one Viterbi launch, whose last thread walks
    the path back on the device (no argmin over state posteriors). The ops: ~43 of preparation, buffers and gather, and
    13 of the check that every target fits its frames (`check_alignable`: a best path must exist; checked on the device
    for GPU-resident values, without a host read)."""
    import seqdist.ctc as ctc
    torch.manual_seed(0)
    lp, targets = torch.randn(1, 30, 8).log_softmax(2), torch.randint(1, 8, (1, 6))
    launches, ops = budget(lambda: ctc.forced_align(lp, targets, backend='cuda'))
    assert launches == {'ctc_prepare': 1, 'ctc_viterbi': 1}
    assert ops.total <= 56, ops.ops          # (the scores are checked for NaN: one host read on the CPU)

def test_forced_align_checkpointed_budget(monkeypatch):
    """Beyond `_CUDA_FULL_TABLE_BYTES`: one launch that keeps the checkpoints, then one a segment (T = 30 frames, k = 7:
    5 segments), the targets (41 states) split across 2 blocks of 32; the walks back on the device. Beyond the one
    launch's ops: a row of `sync` for each further launch, and the checkpoints' and the edges' buffers."""
    import seqdist.ctc as ctc
    torch.manual_seed(0)
    lp, targets = torch.randn(2, 30, 8).log_softmax(2), torch.randint(1, 8, (2, 20))
    _, one = budget(lambda: ctc.forced_align(lp, targets, backend='cuda'))
    monkeypatch.setattr(ctc, '_CUDA_FULL_TABLE_BYTES', 0)
    monkeypatch.setattr(ctc, '_CHECKPOINT_EVERY', 7)
    monkeypatch.setattr(ctc, '_VITERBI_TILE', 32)
    launches, ops = budget(lambda: ctc.forced_align(lp, targets, backend='cuda'))
    assert launches == {'ctc_prepare': 1, 'ctc_viterbi': 6} and ctc._viterbi_launch_plan(30, 2, 41) == (7, 5, 32, 2)
    assert ops.total <= one.total + 5 + 2, ops.ops - one.ops

def test_add_at_columns_budget():
    "CTC_CRF's deterministic scatter on a GPU: a small sort of the (N, J) columns, then one launch over the values."
    from seqdist.crf import add_at_columns
    cols, values, out = torch.randint(0, 7, (3, 9)), torch.randn(5, 3, 9), torch.zeros(5, 3, 7)
    launches, ops = budget(lambda: add_at_columns(out, cols, values, sorted_runs=True))
    assert launches == {'add_at_columns': 1}
    assert ops.total <= 14 and ops.host_reads == 0, ops.ops

def test_tdt_budget_and_no_host_reads_with_gpu_resident_values(monkeypatch):
    """TDT (with omega: two lattices) fwd+bwd: three launches (the rows' lse; alpha and beta of both lattices in one;
    the gradient). With the lengths and labels GPU-resident (`on_host` false) nothing is read by the host."""
    import seqdist.rnnt as rnnt, seqdist.tdt as tdt
    torch.manual_seed(0)
    x = torch.randn(3, 7, 4, 6 + 5, requires_grad=True)
    y, il, tl = torch.randint(0, 5, (3, 3)), torch.tensor([7, 5, 2]), torch.tensor([3, 1, 0])
    f = lambda: torch.autograd.grad(tdt.tdt_loss(x, y, il, tl, sigma=0.05, omega=0.1, backend='cuda'), x)
    launches, ops = budget(f)
    assert launches == {'tdt_lse': 1, 'tdt_alpha_beta': 1, 'tdt_grad': 1}
    assert ops.total <= 60, ops.ops
    monkeypatch.setattr(rnnt, 'on_host', lambda *xs: False)
    monkeypatch.setattr(tdt, 'on_host', lambda *xs: False)
    launches, ops = budget(f)
    assert ops.host_reads == 0, ops.ops

def test_joint_rnnt_budget(monkeypatch):
    """The fused joint + RNN-T loss on the GPU path, forward and backward: per tile, forward `joint_tile_act`, the GEMM
    and `joint_tile_stats` (3 launches), backward `joint_tile_act`, the GEMM, `joint_tile_grad`, dW's addmm, db's addmv,
    dh's GEMM and `joint_tile_backprop` (7), however many utterances the tile spans; the RNN-T lattice's own launches
    (its forward, then its posteriors); no host read with the lengths and labels on the device: the tiles cover the
    padded grid, whose shape the host knows."""
    import seqdist.rnnt as rnnt, seqdist.joint as joint
    monkeypatch.setattr(rnnt, 'on_host', lambda *xs: False)
    torch.manual_seed(0)
    B, T, U, V, H = 2, 6, 3, 10, 4
    xs = [torch.randn(B, T, H, requires_grad=True), torch.randn(B, U + 1, H, requires_grad=True),
          torch.randn(V, H, requires_grad=True), torch.randn(V, requires_grad=True)]
    y, il, tl = torch.randint(1, V, (B, U)), torch.tensor([6, 4]), torch.tensor([3, 2])
    def run():
        loss = joint.joint_rnnt_loss(xs[0], xs[1], xs[2], y, il, tl, bias=xs[3], blank=0, backend="cuda",
                                     tile_bytes=640)     # 16 rows of float32 logits: tiles of 4 frames, one across b
        torch.autograd.grad(loss, xs)
    launches, ops = budget(run)
    tiles = B * T // 4
    assert launches == {'joint_tile_act': 2 * tiles, 'joint_tile_stats': tiles, 'joint_tile_grad': tiles,
                        'joint_tile_backprop': tiles, 'rnnt_lse': 2, 'rnnt_alpha_beta': 2, 'rnnt_edges': 1}, launches
    assert ops.host_reads == 0, ops.ops
    mm = ops.ops['aten.mm.out'], ops.ops['aten.addmm_.default'], ops.ops['aten.addmv_.default']
    assert mm == (3 * tiles, tiles, tiles), ops.ops  # the GEMMs: z forward, z and dh backward; dW; db
    assert ops.total <= 100 + 20 * tiles, ops.total  # checks, the lattice's own (~90); per tile 6 forward, 14 backward

def test_kbest_budgets():
    """k-best on the CUDA kernels (emulated): one launch of the lattice's k-best kernel a call, the walks back on the
    device (TDT's after the rows' log-sum-exp, tdt_lse); the paths' scores are then summed by PyTorch."""
    from seqdist.tdt import kbest_alignments
    from seqdist.crf import CTC_CRF
    torch.manual_seed(0)
    x, y = torch.randn(2, 6, 4, 8 + 3), torch.randint(0, 7, (2, 3))
    launches, _ = budget(lambda: kbest_alignments(x, y, torch.tensor([6, 5]), torch.tensor([3, 2]), (0, 1, 2), k=4, backend='cuda'))
    assert launches == {'tdt_lse': 1, 'tdt_kbest': 1}
    crf = CTC_CRF(2, 'NACGT')
    scores = torch.randn(8, 2, crf.n_score())
    launches, _ = budget(lambda: crf.kbest(scores, 4, backend='cuda'))
    assert launches == {'crf_kbest': 1}
    launches, _ = budget(lambda: crf.kbest(scores, 4, targets=torch.tensor([[1, 2, 3, 4], [2, 2, 1, 0]]),
                                           target_lengths=torch.tensor([4, 3]), backend='cuda'))
    assert launches == {'crf_kbest': 1}
