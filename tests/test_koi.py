"""seqdist.koi: koi.ctc's nine names (ONT's koi 0.6.5, which bonito >= 0.5.1 imports) with koi's signatures and
results, against the algorithms koi runs written in PyTorch (seqdist 0.0.3's, which are koi's), on the CPU, through
the emulated CUDA backend and the reference, in fp32 and fp64, Log and Max; bonito's koi-era CTC_CRF through them
against seqdist.crf.CTC_CRF; install_as_koi; bad inputs."""
import inspect, sys
import pytest, torch
import seqdist.koi as koi
from seqdist import core, ctc_simple, sparse
from seqdist.core import Log, Max
from seqdist.crf import CTC_CRF

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
BACKENDS = ['cpu', 'cuda', 'reference']      # 'cuda' on CPU tensors: the CUDA kernels through the emulator

def close(a, b, dtype):
    assert a.dtype == b.dtype and a.shape == b.shape
    a, b = a.detach(), b.detach()
    assert float((a - b).abs().max()) <= TOL[dtype] * max(1.0, float(b.abs().max())), float((a - b).abs().max())

# koi 0.6.5's koi/ctc.py: each public function's parameters and defaults
KOI_SIGNATURES = {
    'logZ_cu': [('stay_scores', None), ('move_scores', None), ('target_lengths', None), ('S', Log)],
    'viterbi_alignments': [('stay_scores', None), ('move_scores', None), ('target_lengths', None)],
    'logZ_cu_sparse': [('Ms', None), ('idx', None), ('v0', None), ('vT', None), ('S', Log), ('K', 1)],
    'fwd_scores_cu_sparse': [('Ms', None), ('idx', None), ('v0', None), ('S', Log), ('K', 1)],
    'bwd_scores_cu_sparse': [('Ms', None), ('idx', None), ('vT', None), ('S', Log), ('K', 1)],
}

def test_names_and_signatures():
    assert {'SequenceDist', 'Max', 'Log', 'semiring', *KOI_SIGNATURES} <= set(koi.__all__)
    assert (koi.SequenceDist, koi.semiring, koi.Log, koi.Max) == (core.SequenceDist, core.semiring, core.Log, core.Max)
    assert koi.semiring._fields == ('zero', 'one', 'mul', 'sum', 'dsum') and koi.Log.zero == -1e38 and koi.Log.one == 0.
    for name, params in KOI_SIGNATURES.items():
        ps = inspect.signature(getattr(koi, name)).parameters.values()
        positional = [(p.name, None if p.default is p.empty else p.default) for p in ps if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert positional == params, name
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in ps if p.kind is not p.POSITIONAL_OR_KEYWORD)

# --- the target's stay/move lattice ---------------------------------------------------------------------------------

def simple_inputs(dtype, T=7, N=3, L=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    stay, move = torch.randn(T, N, L, generator=g, dtype=dtype), torch.randn(T, N, L - 1, generator=g, dtype=dtype)
    return stay, move, torch.tensor([L, 1, 3][:N])

def koi_logZ(stay, move, lengths, S):
    "koi's LogZ autograd.Function (seqdist 0.0.3's) with the PyTorch forward-backward in place of its CUDA one."
    return ctc_simple.LogZ.apply(stay, move, lengths, ctc_simple._simple_lattice_fwd_bwd, S)

def value_and_grads(f, *xs):
    xs = [x.detach().requires_grad_() for x in xs]
    y = f(*xs)
    w = torch.arange(1., len(y) + 1, dtype=y.dtype)                 # a different weight per sequence
    return [y.detach(), *torch.autograd.grad((y * w).sum(), xs)]

@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('S', [Log, Max])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_logZ_cu(dtype, S, backend):
    stay, move, lengths = simple_inputs(dtype)
    ours = value_and_grads(lambda s, m: koi.logZ_cu(s, m, lengths, S, backend=backend), stay, move)
    for a, b in zip(ours, value_and_grads(lambda s, m: koi_logZ(s, m, lengths, S), stay, move)): close(a, b, dtype)

@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_viterbi_alignments(dtype, backend):
    stay, move, lengths = simple_inputs(dtype)
    s, m = stay.clone().requires_grad_(), move.clone().requires_grad_()
    koi_logZ(s, m, lengths, Max).sum().backward()                   # koi's definition: the gradient of logZ under Max
    expected = s.grad.clone(); expected[:, :, :-1] += m.grad
    got = koi.viterbi_alignments(stay, move, lengths.tolist(), backend=backend)
    assert got.dtype == dtype and not got.requires_grad and torch.equal(got, expected)
    assert torch.equal(got.sum(2), torch.ones(7, 3, dtype=dtype))    # one state per frame

# --- the sparse CRF -------------------------------------------------------------------------------------------------

def sparse_inputs(dtype, NZ, T=5, N=2, C=6, seed=0):
    "A graph in which every state has NZ edges in and NZ out (the CUDA backward kernel's requirement)."
    g = torch.Generator().manual_seed(seed)
    idx = ((torch.arange(C)[:, None] + torch.arange(NZ)[None] * 2) % C).to(torch.int32)
    return (torch.randn(T, N, C, NZ, generator=g, dtype=dtype), idx,
            torch.randn(N, C, generator=g, dtype=dtype), torch.randn(N, C, generator=g, dtype=dtype))

@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('S', [Log, Max])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('NZ', [1, 3, 5, 7])
def test_logZ_cu_sparse(NZ, dtype, S, backend):
    Ms, idx, v0, vT = sparse_inputs(dtype, NZ)
    ours = value_and_grads(lambda x: koi.logZ_cu_sparse(x, idx, v0, vT, S, backend=backend), Ms)
    for a, b in zip(ours, value_and_grads(lambda x: sparse.logZ_reference(x, idx, v0, vT, S), Ms)): close(a, b, dtype)

@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('S', [Log, Max])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_fwd_bwd_scores_cu_sparse(dtype, S, backend):
    Ms, idx, v0, vT = sparse_inputs(dtype, 5)
    Ms.requires_grad_()
    alpha, beta = koi.fwd_scores_cu_sparse(Ms, idx, v0, S, backend=backend), koi.bwd_scores_cu_sparse(Ms, idx, vT, S, backend=backend)
    assert not alpha.requires_grad and not beta.requires_grad
    close(alpha, sparse.Mv_scan_py(Ms.detach(), idx.long(), v0, S), dtype)
    close(beta, sparse.bwd_scores_py(Ms.detach(), idx, vT, S), dtype)

def test_K_tunes_never_changes_and_v0_vT_get_no_gradient():
    Ms, idx, v0, vT = sparse_inputs(torch.float64, 5, C=40)
    ref = koi.logZ_cu_sparse(Ms, idx, v0, vT, backend='cpu')
    for K in (1, 2, 4):           # koi takes only K=1
        assert torch.allclose(koi.logZ_cu_sparse(Ms, idx, v0, vT, Log, K, backend='cuda'), ref, rtol=1e-12)
        assert torch.allclose(koi.fwd_scores_cu_sparse(Ms, idx, v0, Log, K, backend='cuda'), koi.fwd_scores_cu_sparse(Ms, idx, v0))
    Ms, v0, vT = (x.clone().requires_grad_() for x in (Ms, v0, vT))
    koi.logZ_cu_sparse(Ms, idx, v0, vT).sum().backward()
    assert Ms.grad is not None and v0.grad is None and vT.grad is None           # as koi: Ms only

def test_idx_of_any_integer_dtype_and_inputs_left_unmodified():
    Ms, idx, v0, vT = sparse_inputs(torch.float32, 3)
    copies = [x.clone() for x in (Ms, idx, v0, vT)]
    ref = koi.logZ_cu_sparse(Ms, idx, v0, vT)
    for dt in (torch.int16, torch.uint8, torch.int64):
        assert torch.equal(koi.logZ_cu_sparse(Ms, idx.to(dt), v0, vT), ref)
    assert torch.equal(koi.logZ_cu_sparse(Ms.transpose(0, 1).contiguous().transpose(0, 1), idx, v0, vT), ref)   # a view
    assert all(torch.equal(a, b) for a, b in zip((Ms, idx, v0, vT), copies))

# --- bonito's koi-era CTC_CRF ---------------------------------------------------------------------------------------

@pytest.fixture
def koi_ctc(monkeypatch):
    "`koi.ctc` as bonito imports it, after install_as_koi (sys.modules restored afterwards)."
    for name in ('koi', 'koi.ctc', 'koi.lstm', 'koi.decode'): monkeypatch.delitem(sys.modules, name, raising=False)
    koi.install_as_koi()
    import koi.ctc as ctc
    yield ctc
    for name in ('koi', 'koi.ctc', 'koi.lstm', 'koi.decode'): sys.modules.pop(name, None)

def koi_era_ctc_crf(ctc, ctc_dtype):
    "bonito >= 0.5.1's CTC_CRF (bonito/crf/model.py), written from its public design over the names of `ctc`."
    class KoiEraCTC_CRF(ctc.SequenceDist):
        def __init__(self, state_len, alphabet):
            super().__init__()
            self.state_len, self.alphabet, self.n_base = state_len, alphabet, len(alphabet) - 1
            C = self.n_base ** state_len
            self.idx = torch.cat([torch.arange(C)[:, None], torch.arange(self.n_base)[None] * (C // self.n_base)
                                  + torch.arange(C)[:, None] // self.n_base], 1).to(torch.int32)

        def _Ms(self, scores): return scores.reshape(*scores.shape[:2], -1, len(self.alphabet))
        def _ends(self, Ms, S): return Ms.new_full((Ms.shape[1], self.idx.shape[0]), S.one)

        def logZ(self, scores, S=ctc.Log):
            Ms = self._Ms(scores)
            return ctc.logZ_cu_sparse(Ms, self.idx, self._ends(Ms, S), self._ends(Ms, S), S)

        def normalise(self, scores): return scores - self.logZ(scores)[:, None] / len(scores)
        def forward_scores(self, scores, S=ctc.Log):
            Ms = self._Ms(scores); return ctc.fwd_scores_cu_sparse(Ms, self.idx, self._ends(Ms, S), S, K=1)
        def backward_scores(self, scores, S=ctc.Log):
            Ms = self._Ms(scores); return ctc.bwd_scores_cu_sparse(Ms, self.idx, self._ends(Ms, S), S, K=1)

        def viterbi(self, scores):
            edge = self.posteriors(scores, ctc.Max).argmax(2)
            move = edge % len(self.alphabet) != 0
            return torch.where(move, 1 + torch.div(edge, len(self.alphabet), rounding_mode='floor') % self.n_base, 0)

        def prepare_ctc_scores(self, scores, targets):
            bases, n = (targets - 1).clamp(min=0), targets.shape[1] - self.state_len + 1
            scores = scores.to(ctc_dtype)                     # bonito: float32, all koi has
            stay = sum(bases[:, i:i + n] * self.n_base ** (self.state_len - 1 - i) for i in range(self.state_len)) * len(self.alphabet)
            move = stay[:, 1:] + 1 + bases[:, :n - 1]
            gather = lambda cols: scores.gather(2, cols.expand(len(scores), -1, -1))
            return gather(stay), gather(move)

        def ctc_loss(self, scores, targets, target_lengths, loss_clip=None, reduction='mean', normalise_scores=True):
            if normalise_scores: scores = self.normalise(scores)
            loss = -ctc.logZ_cu(*self.prepare_ctc_scores(scores, targets), target_lengths + 1 - self.state_len) / target_lengths
            if loss_clip: loss = torch.clamp(loss, 0.0, loss_clip)
            return loss.mean() if reduction == 'mean' else loss

        def ctc_viterbi_alignments(self, scores, targets, target_lengths):
            return ctc.viterbi_alignments(*self.prepare_ctc_scores(scores, targets), target_lengths + 1 - self.state_len)
    return KoiEraCTC_CRF

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_bonito_koi_era_ctc_crf_equals_ctc_crf(koi_ctc, dtype):
    assert koi_ctc is koi and koi_ctc.logZ_cu is koi.logZ_cu
    theirs, ours = koi_era_ctc_crf(koi_ctc, dtype)(2, 'NACGT'), CTC_CRF(2, 'NACGT')
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(12, 3, ours.n_score(), generator=g, dtype=dtype, requires_grad=True)
    targets, lengths = torch.randint(1, 5, (3, 6), generator=g), torch.tensor([6, 4, 2])
    for S in (Log, Max):
        close(theirs.logZ(scores, S), ours.logZ(scores, S), dtype)
        close(theirs.posteriors(scores, S), ours.posteriors(scores, S), dtype)
        close(theirs.forward_scores(scores, S), ours.forward_scores(scores, S), dtype)
        close(theirs.backward_scores(scores, S), ours.backward_scores(scores, S), dtype)
    assert torch.equal(theirs.viterbi(scores), ours.viterbi(scores))
    for kw in ({}, {'reduction': 'none'}, {'normalise_scores': False}, {'loss_clip': 0.5, 'reduction': 'none'}):
        a, b = theirs.ctc_loss(scores, targets, lengths, **kw), ours.ctc_loss(scores, targets, lengths, **kw)
        close(a, b, dtype)
        close(*(torch.autograd.grad(x.sum(), scores)[0] for x in (a, b)), dtype)
    assert torch.equal(theirs.ctc_viterbi_alignments(scores, targets, lengths), ours.ctc_viterbi_alignments(scores, targets, lengths))

def test_install_as_koi_stand_in(koi_ctc):
    import koi.lstm as lstm, koi.decode as decode     # bonito's CRF model and basecaller import these
    from koi.decode import beam_search, to_str        # seqdist's (tests/test_koi_decode.py checks them)
    assert decode is koi.decode and (beam_search, to_str) == (koi.decode.beam_search, koi.decode.to_str)
    from koi.lstm import update_graph                 # seqdist's (tests/test_koi_lstm.py checks it)
    assert lstm is koi.lstm and update_graph is koi.lstm.update_graph
    assert sys.modules['koi'].ctc is koi_ctc and koi.install_as_koi() is koi_ctc     # idempotent

# --- bad inputs -----------------------------------------------------------------------------------------------------

def bad_cases():
    stay, move, lengths = simple_inputs(torch.float32)
    Ms, idx, v0, vT = sparse_inputs(torch.float32, 3)
    return [
        ('logZ_cu stay 2-D', lambda: koi.logZ_cu(stay[0], move, lengths), ValueError, 'stay_scores'),
        ('logZ_cu move shape', lambda: koi.logZ_cu(stay, move[:, :, :2], lengths), ValueError, 'move_scores'),
        ('logZ_cu half', lambda: koi.logZ_cu(stay.half(), move.half(), lengths), TypeError, 'stay_scores'),
        ('logZ_cu length 0', lambda: koi.logZ_cu(stay, move, torch.tensor([5, 0, 1])), ValueError, 'target_lengths'),
        ('logZ_cu length > L', lambda: koi.logZ_cu(stay, move, torch.tensor([6, 1, 1])), ValueError, 'target_lengths'),
        ('logZ_cu lengths count', lambda: koi.logZ_cu(stay, move, torch.tensor([5, 1])), ValueError, 'target_lengths'),
        ('logZ_cu semiring', lambda: koi.logZ_cu(stay, move, lengths, S='Log'), ValueError, 'S must be'),
        ('logZ_cu backend', lambda: koi.logZ_cu(stay, move, lengths, backend='gpu'), ValueError, 'backend'),
        ('viterbi length 0', lambda: koi.viterbi_alignments(stay, move, torch.tensor([5, 0, 1])), ValueError, 'target_lengths'),
        ('sparse Ms 3-D', lambda: koi.logZ_cu_sparse(Ms[0], idx, v0, vT), ValueError, 'Ms'),
        ('sparse Ms half', lambda: koi.logZ_cu_sparse(Ms.half(), idx, v0, vT), TypeError, 'Ms'),
        ('sparse idx float', lambda: koi.logZ_cu_sparse(Ms, idx.float(), v0, vT), TypeError, 'idx'),
        ('sparse idx shape', lambda: koi.logZ_cu_sparse(Ms, idx[:, :2], v0, vT), ValueError, 'idx'),
        ('sparse idx range', lambda: koi.logZ_cu_sparse(Ms, idx + 1, v0, vT), ValueError, 'idx'),
        ('sparse v0 shape', lambda: koi.logZ_cu_sparse(Ms, idx, v0[:, :3], vT), ValueError, 'v0'),
        ('sparse vT dtype', lambda: koi.logZ_cu_sparse(Ms, idx, v0, vT.double()), TypeError, 'vT'),
        ('sparse K', lambda: koi.logZ_cu_sparse(Ms, idx, v0, vT, Log, 0), ValueError, 'K'),
        ('sparse semiring', lambda: koi.logZ_cu_sparse(Ms, idx, v0, vT, S=None), ValueError, 'S must be'),
        ('fwd idx range', lambda: koi.fwd_scores_cu_sparse(Ms, idx - 1, v0), ValueError, 'idx'),
        ('fwd semiring', lambda: koi.fwd_scores_cu_sparse(Ms, idx, v0, S=None), ValueError, 'S must be'),
        ('bwd vT shape', lambda: koi.bwd_scores_cu_sparse(Ms, idx, vT[0]), ValueError, 'vT'),
        ('bwd K', lambda: koi.bwd_scores_cu_sparse(Ms, idx, vT, Log, -1), ValueError, 'K'),
    ]

@pytest.mark.parametrize('case', bad_cases(), ids=lambda c: c[0])
def test_bad_inputs(case):
    _, call, error, match = case
    with pytest.raises(error, match=match): call()
