"""Sparse CRF: reference = brute force; cpu, cuda (emulated) and reference agree on logZ, its gradient, and the
forward / backward scores, in both semirings and dtypes, for several K and the looping path; 0.0.3 names."""
import itertools, math, pytest, torch
import torch.nn.functional as F
from seqdist.core import Log, Max
from seqdist.sparse import (logZ, logZ_reference, logZ_scan_py, logZ_scan, fwd_scores_cupy,
                            bwd_scores_cupy, bwd_scores_py, Mv_scan_py, Mv_scan_cupy, logZ_fwd_cupy, logZ_bwd_cupy,
                            ctc_loss, ctc_loss_scan, ctc_loss_scan_py)
from seqdist.utils import emulator_options

def sparse_logz_compute(Ms, idx, v0, vT, use_max, with_grad, backend='auto', K=1):
    "logZ (N,) and its gradient w.r.t. Ms (the edge posteriors, or the best path), by `logZ` and autograd (with_grad: always)."
    x = Ms.detach().clone().requires_grad_()
    z = logZ(x, idx, v0, vT, Max if use_max else Log, K, backend)
    return z.detach(), torch.autograd.grad(z.sum(), x)[0]

def kmer_idx(state_len, n_base=4):
    C = n_base ** state_len
    c = torch.arange(C)[:, None]
    return torch.cat([c, (c // n_base) + torch.arange(n_base)[None] * n_base ** (state_len - 1)], 1)

def brute_force(Ms, idx, v0, vT, S):
    T, N, C, NZ = Ms.shape
    out = []
    for n in range(N):
        scores = []
        for p in itertools.product(range(C), repeat=T + 1):
            terms = [v0[n, p[0]], vT[n, p[-1]]]
            for t in range(T):
                ways = [Ms[t, n, p[t + 1], j] for j in range(NZ) if idx[p[t + 1], j] == p[t]]
                if not ways: break
                terms.append(S.sum(torch.stack(ways), dim=0))
            else: scores.append(sum(terms))
        out.append(S.sum(torch.stack(scores), dim=0))
    return torch.stack(out)

@pytest.mark.parametrize('S', [Log, Max])
@pytest.mark.parametrize('offsets', [(0, 1, 3), (0, 1, 3, 2, 1, 0, 3)])   # NZ 3 and 7: the CUDA kernel's groups of 5 masked
def test_brute_force(S, offsets):
    """logZ against enumeration on every backend, and its gradient (the edges' posteriors) as the reference's, with
    NZ edges into each state from states c + offsets (mod C): also multi-edges, and NZ other than the CTC-CRF's 5."""
    torch.manual_seed(0)
    T, N, C, NZ = 3, 2, 4, len(offsets)
    Ms = torch.randn(T, N, C, NZ, dtype=torch.float64)
    idx = torch.tensor([[(c + o) % C for o in offsets] for c in range(C)], dtype=torch.int32)
    v0, vT = torch.randn(N, C, dtype=torch.float64), torch.randn(N, C, dtype=torch.float64)
    truth = brute_force(Ms, idx, v0, vT, S)
    grads = {}
    for backend in ('reference', 'cpu', 'cuda'):
        x = Ms.clone().requires_grad_()
        z = logZ(x, idx, v0, vT, S, backend=backend)
        torch.testing.assert_close(z, truth, rtol=1e-12, atol=1e-12)
        grads[backend] = torch.autograd.grad(z.sum(), x)[0]
    for backend in ('cpu', 'cuda'): torch.testing.assert_close(grads[backend], grads['reference'], rtol=1e-10, atol=1e-10)

@pytest.mark.parametrize('S', [Log, Max])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('state_len,K', [(2, 1), (3, 1), (3, 2), (3, 4)])   # C=64 with K>1: fewer threads than states
def test_three_paths_agree(S, dtype, state_len, K):
    torch.manual_seed(1)
    T, N = 9, 3
    idx = kmer_idx(state_len).int()
    C = idx.shape[0]
    Ms = torch.randn(T, N, C, 5, dtype=torch.float64).to(dtype)
    v0, vT = torch.randn(N, C, dtype=torch.float64).to(dtype), torch.zeros(N, C, dtype=dtype)
    ref = sparse_logz_compute(Ms, idx, v0, vT, S is Max, True, 'reference')
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-11)
    for backend in ('cpu', 'cuda'):
        with emulator_options(seed=K):
            z, g = sparse_logz_compute(Ms, idx, v0, vT, S is Max, True, backend, K)
        torch.testing.assert_close(z, ref[0], **tol); torch.testing.assert_close(g, ref[1], **tol)
        for fn, v in ((fwd_scores_cupy, v0), (bwd_scores_cupy, vT)):
            with emulator_options(seed=K):
                got = fn(Ms, idx, v, S, K, backend=backend)
            torch.testing.assert_close(got, fn(Ms, idx, v, S, K, backend='reference'), **tol)

def test_scores_are_consistent_with_logz():
    torch.manual_seed(0)
    T, N = 12, 2
    idx = kmer_idx(2)
    Ms = torch.randn(T, N, 16, 5, dtype=torch.float64)
    v0 = vT = torch.zeros(N, 16, dtype=torch.float64)
    alpha, beta = fwd_scores_cupy(Ms, idx, v0), bwd_scores_cupy(Ms, idx, vT)
    z = logZ(Ms, idx, v0, vT)
    torch.testing.assert_close(torch.logsumexp(alpha + beta, -1), z[None].expand(T + 1, -1))
    torch.testing.assert_close(beta, bwd_scores_py(Ms, idx, vT))

def test_gradcheck():
    torch.manual_seed(0)
    idx = kmer_idx(1)
    Ms = torch.randn(4, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    v0, vT = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    for backend in ('cpu', 'reference', 'cuda'):
        assert torch.autograd.gradcheck(lambda m: logZ(m, idx, v0, vT, backend=backend), (Ms,))

def test_peaked_scores_fall_back_to_log_space():
    torch.manual_seed(0)
    idx = kmer_idx(2)
    Ms = torch.randn(30, 3, 16, 5) * 60                    # frames span far more than exp can hold in float32
    v0 = vT = torch.zeros(3, 16)
    z, g = sparse_logz_compute(Ms, idx, v0, vT, False, True, 'cpu')
    zr, gr = sparse_logz_compute(Ms.double(), idx, v0.double(), vT.double(), False, True, 'reference')
    torch.testing.assert_close(z.double(), zr, rtol=1e-6, atol=1e-3); torch.testing.assert_close(g.double(), gr, rtol=0, atol=1e-5)

def test_seqdist_003_names():
    torch.manual_seed(0)
    idx = kmer_idx(2)
    Ms = torch.randn(10, 2, 16, 5, dtype=torch.float64, requires_grad=True)
    v0 = vT = torch.zeros(2, 16, dtype=torch.float64)
    z = logZ(Ms, idx.int(), v0, vT, Log, K=1)
    for f in (logZ_scan_py, logZ_scan):
        torch.testing.assert_close(f(Ms, idx, v0, vT, Log), z)
    torch.testing.assert_close(torch.autograd.grad(logZ_scan(Ms, idx, v0, vT, Log).sum(), Ms)[0],
                               torch.autograd.grad(z.sum(), Ms)[0])
    torch.testing.assert_close(Mv_scan_cupy(Ms, idx, v0), Mv_scan_py(Ms, idx, v0))
    lz, part = logZ_fwd_cupy(Ms, idx, v0, vT)
    torch.testing.assert_close(lz, z)
    assert logZ_bwd_cupy is bwd_scores_cupy
    logits = torch.randn(30, 3, 6, dtype=torch.float64)
    targets, il, tl = torch.randint(1, 6, (3, 5)), torch.full((3,), 30), torch.tensor([5, 3, 4])
    expected = F.ctc_loss(logits.log_softmax(2), targets, il, tl)
    for f in (ctc_loss, ctc_loss_scan, ctc_loss_scan_py):
        torch.testing.assert_close(f(logits, targets, il, tl), expected)

def test_backward_twice_with_retain_graph():
    Ms = torch.randn(5, 2, 16, 5, requires_grad=True)
    z = logZ(Ms, kmer_idx(2), torch.zeros(2, 16), torch.zeros(2, 16)).sum()
    g1, = torch.autograd.grad(z, Ms, retain_graph=True)
    g2, = torch.autograd.grad(z, Ms)
    assert torch.equal(g1, g2)

Ms0, idx0, v00 = torch.randn(4, 2, 16, 5), kmer_idx(2), torch.zeros(2, 16)
BAD = [
    (dict(Ms=Ms0[0]), ValueError, r"Ms must be a \(T, N, C, NZ\) tensor, got torch.Size\(\[2, 16, 5\]\)"),
    (dict(Ms=Ms0.half()), TypeError, r"Ms must be float32 or float64, got torch.float16"),
    (dict(idx=idx0.float()), TypeError, r"idx must be an int32 or int64 tensor, got torch.float32"),
    (dict(idx=idx0[:, :4]), ValueError, r"idx must have shape \(C, NZ\) = \(16, 5\), got \(16, 4\)"),
    (dict(idx=idx0 + 1), ValueError, r"idx must hold states in \[0, C\) = \[0, 16\), got values in \[1, 16\]"),
    (dict(v0=v00[:1]), ValueError, r"v0 must be a \(2, 16\) tensor, got torch.Size\(\[1, 16\]\)"),
    (dict(vT=v00.double()), TypeError, r"vT must have Ms' dtype and device"),
    (dict(K=0), ValueError, r"K must be a positive int, got 0"),
    (dict(S='Log'), ValueError, r"S must be Log or Max, got 'Log'"),
    (dict(backend='gpu'), ValueError, r"backend must be 'auto', 'cpu', 'cuda' or 'reference', got 'gpu'"),
]

@pytest.mark.parametrize('bad,error,message', BAD)
def test_bad_input_is_a_clear_error(bad, error, message):
    args = dict(Ms=Ms0, idx=idx0, v0=v00, vT=v00)
    args.update(bad)
    with pytest.raises(error, match=message): logZ(**args)

def test_cuda_kernels_need_regular_out_degree():
    idx = torch.tensor([[0, 1], [0, 1], [0, 2]])      # state 0 has 3 outgoing edges, state 2 one
    with pytest.raises(ValueError, match="every state to have NZ = 2 outgoing edges"):   # the backward kernel needs it
        logZ(torch.randn(3, 1, 3, 2, requires_grad=True), idx, torch.zeros(1, 3), torch.zeros(1, 3), backend='cuda')
    Ms, v0, vT = torch.randn(3, 2, 3, 2, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    for S in (Log, Max):                                                    # the CPU kernel takes any graph
        z, g = sparse_logz_compute(Ms, idx, v0, vT, S is Max, True, 'cpu')
        zr, gr = sparse_logz_compute(Ms, idx, v0, vT, S is Max, True, 'reference')
        torch.testing.assert_close(z, zr); torch.testing.assert_close(g, gr)

@pytest.mark.parametrize('N', [1, 5, 9])
@pytest.mark.parametrize('S', [Log, Max])
def test_bundles_of_any_size_and_weighted_gradients(N, S):
    "Sequences go through the CPU kernel in bundles of 4, the last one filled by repeating its last sequence."
    torch.manual_seed(N)
    idx = kmer_idx(2)
    Ms = torch.randn(7, N, 16, 5, dtype=torch.float64)
    v0, vT = torch.randn(N, 16, dtype=torch.float64), torch.randn(N, 16, dtype=torch.float64)
    zr, gr = sparse_logz_compute(Ms, idx, v0, vT, S is Max, True, 'reference')
    weights = torch.rand(N, dtype=torch.float64)
    x = Ms.clone().requires_grad_()
    z = logZ(x, idx, v0, vT, S, backend='cpu')
    g, = torch.autograd.grad((z * weights).sum(), x)
    torch.testing.assert_close(z.detach(), zr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, gr * weights[None, :, None, None], rtol=1e-12, atol=1e-12)

def _ring(C=4):
    "Each state entered from itself (j = 0) and from the state before it (j = 1)."
    return torch.tensor([[c, (c - 1) % C] for c in range(C)])

def test_a_score_that_could_underflow_forward_goes_to_log_space():
    "Frames span 250 (< 300), but two moves of e^-250 leave a score e^-500 below its frame's best: flagged, redone."
    from seqdist.sparse import _sparse_forward_numba
    idx = _ring()
    Ms = torch.full((4, 2, 4, 2), -250.0, dtype=torch.float64)
    Ms[:, :, 0, 0] = 0.0
    no = -1000.0                                                # (not -inf: the reference's autograd gives NaN there)
    v0 = torch.tensor([[0.0, no, no, no]] * 2, dtype=torch.float64)
    vT = torch.tensor([[no, no, no, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    ok = _sparse_forward_numba(Ms, idx, v0, vT, Log, True)[3]
    assert not ok[0] and not ok[1]
    for S in (Log, Max):
        z, g = sparse_logz_compute(Ms, idx, v0, vT, S is Max, True, 'cpu')
        zr, gr = sparse_logz_compute(Ms, idx, v0, vT, S is Max, True, 'reference')
        assert z[0] < -700
        torch.testing.assert_close(z, zr, rtol=1e-12, atol=1e-12); torch.testing.assert_close(g, gr, rtol=1e-12, atol=1e-12)

def test_a_score_that_could_underflow_backward_goes_to_log_space():
    "The forward pass is fine (every state moves on at weight 1), the backward scores fall e^-500 apart: redone."
    from seqdist.sparse import _sparse_forward_numba, _bundle_backward, out_edges_padded, scaled_start
    idx = _ring()
    Ms = torch.full((5, 1, 4, 2), -250.0)
    Ms[:, :, :, 1] = 0.0
    v0 = torch.zeros(1, 4)
    vT = torch.tensor([[0.0, -1000.0, -1000.0, -1000.0]])
    logz, alpha, frames, ok = _sparse_forward_numba(Ms, idx, v0, vT, Log, True)
    assert ok.all()
    okb, grad = ok.clone(), torch.empty_like(Ms)
    _bundle_backward(Ms.numpy(), frames[0].numpy(), idx.numpy(), out_edges_padded(idx).numpy(), scaled_start(vT)[0].numpy(),
                     alpha.numpy(), frames[1].numpy(), torch.ones(1, dtype=torch.float64).numpy(), False, False, grad.numpy(), okb.numpy(), 0, 1)
    assert not okb.any()
    z, g = sparse_logz_compute(Ms, idx, v0, vT, False, True, 'cpu')
    zr, gr = sparse_logz_compute(Ms.double(), idx, v0.double(), vT.double(), False, True, 'reference')
    torch.testing.assert_close(z.double(), zr, rtol=1e-6, atol=1e-4); torch.testing.assert_close(g.double(), gr, rtol=0, atol=1e-6)

def test_views_and_inputs_left_unmodified():
    torch.manual_seed(0)
    idx = kmer_idx(2)
    base = torch.randn(3, 6, 16, 5)
    Ms = base.transpose(0, 1)                                   # (6, 3, 16, 5), not contiguous
    v0, vT = torch.randn(16, 3).T, torch.zeros(3, 16)
    copies = [t.clone() for t in (Ms, v0, vT)]
    x = Ms.detach().requires_grad_()
    z = logZ(x, idx.int(), v0, vT)
    g, = torch.autograd.grad(z.sum(), x)
    zr, gr = sparse_logz_compute(Ms.double(), idx, v0.double(), vT.double(), False, True, 'reference')
    torch.testing.assert_close(z.double(), zr, rtol=1e-6, atol=1e-5); torch.testing.assert_close(g.double(), gr, rtol=1e-5, atol=1e-6)
    for t, c in zip((Ms, v0, vT), copies): assert torch.equal(t, c)

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_impossible_starts_and_ends(backend):
    "-inf in v0 / vT forbids states; a sequence with no path gets logZ = -inf and a zero gradient."
    torch.manual_seed(0)
    idx, inf = _ring(), float('inf')
    Ms = torch.randn(3, 3, 4, 2, dtype=torch.float64, requires_grad=True)
    v0 = torch.tensor([[0.0, -inf, -inf, -inf], [0, 0, 0, 0], [-inf] * 4], dtype=torch.float64)
    vT = torch.tensor([[-inf, -inf, 0.0, -inf], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    for S in (Log, Max):
        z = logZ(Ms, idx, v0, vT, S, backend=backend)
        g, = torch.autograd.grad(z.sum(), Ms)
        zr, gr = sparse_logz_compute(Ms.detach(), idx, v0.clamp(min=-1e4), vT.clamp(min=-1e4), S is Max, True, 'reference')
        torch.testing.assert_close(z[:2].detach(), zr[:2]); torch.testing.assert_close(g[:, :2], gr[:, :2])
        assert z[2] == -inf and not g[:, 2].any()

def test_no_frames():
    "T = 0: a path is a single state, logZ = (+)_c v0 (x) vT, and the gradient is empty."
    torch.manual_seed(0)
    Ms = torch.randn(0, 2, 4, 2, dtype=torch.float64, requires_grad=True)
    v0, vT = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    for S in (Log, Max):
        for backend in ('cpu', 'cuda', 'reference'):
            z = logZ(Ms, _ring(), v0, vT, S, backend=backend)
            torch.testing.assert_close(z.detach(), S.sum(v0 + vT, dim=1))
            assert torch.autograd.grad(z.sum(), Ms)[0].shape == Ms.shape

def test_idx_is_checked_and_moved_once_and_again_after_an_in_place_change():
    "A training step passes the same idx every time: it is checked and copied once (no host-device sync per call)."
    from seqdist.sparse import check_sparse_inputs
    from seqdist.crf import kmer_transitions
    idx = kmer_transitions(2, 4)                                       # int32, as bonito keeps it
    Ms = torch.randn(3, 2, 16, 5)
    first = check_sparse_inputs(Ms, idx)
    assert first.dtype == torch.int64 and torch.equal(first, idx.long())
    assert check_sparse_inputs(Ms, idx) is first
    idx[0, 0] = 16                                                     # now out of range: checked again
    with pytest.raises(ValueError, match=r"idx must hold states in \[0, C\) = \[0, 16\), got values in \[0, 16\]"):
        check_sparse_inputs(Ms, idx)
    idx[0, 0] = 0
    assert torch.equal(check_sparse_inputs(Ms, idx), first) and check_sparse_inputs(Ms, idx) is not first

def test_backward_op_takes_the_callers_idx_as_it_was_saved():
    "The backward op gets the idx the caller passed (int32, possibly on another device) and normalises it itself."
    from seqdist.crf import kmer_transitions
    idx = kmer_transitions(2, 4)
    Ms = torch.randn(4, 3, 16, 5, dtype=torch.float64, requires_grad=True)
    v = torch.zeros(3, 16, dtype=torch.float64)
    for backend in ('cpu', 'cuda'):
        g, = torch.autograd.grad(logZ(Ms, idx, v, v, backend=backend).sum(), Ms)
        g_ref, = torch.autograd.grad(logZ(Ms, idx.long(), v, v, backend='reference').sum(), Ms)
        torch.testing.assert_close(g, g_ref)

def test_unbounded_variant_runs_and_agrees(monkeypatch):
    """$SEQDIST_SPARSE_BOUNDS=1 (the recursions without float's two-blocks bound on sm_90, for the GPU run to compare)
    compiles, runs and gives the default's bits through the emulator; another value is a clear error."""
    g = torch.Generator().manual_seed(3)
    Ms = torch.randn(6, 2, 16, 3, generator=g).log_softmax(-1).requires_grad_()
    v0 = torch.zeros(2, 16)
    idx = torch.stack([torch.roll(torch.arange(16), k) for k in range(3)], 1)     # every state 3 out-edges
    runs = []
    for bounds in ('2', '1'):
        monkeypatch.setenv('SEQDIST_SPARSE_BOUNDS', bounds)
        z = logZ(Ms, idx, v0, v0, backend='cuda')
        runs.append((z.detach(), torch.autograd.grad(z.sum(), Ms)[0]))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    monkeypatch.setenv('SEQDIST_SPARSE_BOUNDS', '3')
    with pytest.raises(ValueError, match="SEQDIST_SPARSE_BOUNDS must be '2' or '1', got '3'"): logZ(Ms, idx, v0, v0, backend='cuda')

def test_base2_variant_keeps_float32s_error(monkeypatch):
    """$SEQDIST_SPARSE_LOG2=1 (float Log's recursions on log2-scaled scores, for the GPU run to compare): logZ and its
    gradient as close to float64's as the default's (a DNA CTC-CRF's transitions, NZ=5; start and end scores not zero,
    some -inf; a sequence with a NaN score comes out NaN); float64 and Max keep the default's bits (the variant is float
    Log's alone); another value is a clear error."""
    from seqdist.crf import kmer_transitions      # (with $SEQDIST_SPARSE_BOUNDS=1 the same source, launch bounds apart)
    g = torch.Generator().manual_seed(4)
    idx = kmer_transitions(3, 4)
    T, N, C = 40, 3, idx.shape[0]
    Ms = torch.randn(T, N, C, 5, generator=g, dtype=torch.float64).log_softmax(-1) * 3
    v0, vT = torch.randn(N, C, generator=g, dtype=torch.float64), torch.randn(N, C, generator=g, dtype=torch.float64)
    v0[0, :10] = -math.inf
    Ms[3, 1, 7, 2] = math.nan
    exact = [logZ(Ms.requires_grad_(), idx, v0, vT, backend='cpu')]
    exact.append(torch.autograd.grad(exact[0].sum(), Ms)[0])
    def run(dtype, S=Log):
        x = Ms.detach().to(dtype).requires_grad_()
        z = logZ(x, idx, v0.to(dtype), vT.to(dtype), S, backend='cuda')
        return z.detach(), torch.autograd.grad(z.sum(), x)[0]
    errors = {}
    for log2 in ('0', '1'):
        monkeypatch.setenv('SEQDIST_SPARSE_LOG2', log2)
        z, grad = run(torch.float32)
        assert torch.equal(z.isnan(), torch.tensor([False, True, False])) and grad[:, 1].isnan().all()
        errors[log2] = ((z.double() - exact[0])[[0, 2]].abs().max(), (grad.double() - exact[1])[:, [0, 2]].abs().max())
        if log2 == '0': default = [run(torch.float64), run(torch.float64, Max), run(torch.float32, Max)]
        else:
            for r, d in zip([run(torch.float64), run(torch.float64, Max), run(torch.float32, Max)], default):
                for a, b in zip(r, d): torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    ulp = torch.finfo(torch.float32).eps * exact[0][[0, 2]].abs().max()          # float32's rounding of logZ
    assert errors['1'][0] <= max(2 * errors['0'][0], 4 * ulp) and errors['1'][1] <= 2 * errors['0'][1], errors
    monkeypatch.setenv('SEQDIST_SPARSE_LOG2', 'yes')
    with pytest.raises(ValueError, match="SEQDIST_SPARSE_LOG2 must be '0' or '1', got 'yes'"): run(torch.float32)
