"""Bad input that once crashed a kernel or was read stale: NaN scores in the alignment calls (refused by name), a kernel
fed NaN directly (no write outside its buffers), and a graph changed behind its version counter."""
import subprocess, sys, textwrap
import numpy as np
import pytest, torch
from seqdist import rnnt, sparse

def rnnt_case(nan_at=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 4, 5, generator=g, dtype=torch.float64)
    if nan_at is not None: x[nan_at] = float('nan')
    return x, torch.randint(1, 5, (3, 3), generator=g), torch.tensor([6, 5, 4]), torch.tensor([3, 2, 3])

CALLS = {'kbest_alignments': lambda a, b: rnnt.kbest_alignments(*a, blank=0, k=3, backend=b),
         'sample_alignments': lambda a, b: rnnt.sample_alignments(*a, blank=0, n=2, backend=b,
                                                                  generator=torch.Generator().manual_seed(5)),
         'best_path': lambda a, b: rnnt.best_path(*a, blank=0, backend=b)}

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
@pytest.mark.parametrize('call', sorted(CALLS))
def test_rnnt_alignment_calls_refuse_nan_by_sequence(call, backend):
    "A NaN inside sequence 1's lattice: a ValueError naming it (the CPU k-best kernel once walked garbage back-pointers)."
    with pytest.raises(ValueError, match=r"logits of sequence 1 hold NaN or \+inf within its lengths"):
        CALLS[call](rnnt_case(nan_at=(1, 2, 1, 3)), backend)

@pytest.mark.parametrize('call', sorted(CALLS))
def test_a_nan_outside_the_lengths_is_padding(call):
    "Frame 5 of sequence 1 (T_1 = 5) and node 3 of sequence 1 (U_1 = 2) are padding: their NaN is never read."
    args = rnnt_case()
    for at in [(1, 5, 0, 0), (1, 0, 3, 2)]:
        bad = rnnt_case(nan_at=at)
        want, got = CALLS[call](args, 'cpu'), CALLS[call](bad, 'cpu')
        for w, g in zip(want, got): assert torch.equal(w, g)

def test_the_kbest_kernel_fed_nan_directly_writes_nothing_outside_its_buffers():
    """The numba kernel itself, without the API's check, on all-NaN logits: it ends (no path walked) in a process of its
    own; before, it walked back-pointers a NaN never set and wrote past `frames` (glibc: free(): invalid pointer)."""
    code = textwrap.dedent("""
        import numpy as np
        from seqdist.rnnt import _rnnt_kbest_cpu
        B, T, U1, V, k = 2, 6, 4, 5, 3
        x = np.full((B, T, U1, V), np.nan)
        frames, best = np.full((k, B, U1 - 1), -1), np.empty((k, B))
        _rnnt_kbest_cpu(x, np.ones((B, U1 - 1), np.int64), np.array([6, 5]), np.array([3, 2]), 0, True, True, k, frames,
                        best, 0, B)
        assert (frames == -1).all() and np.isinf(best).all(), (frames, best)
        print('ok')""")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == 'ok', r.stderr[-2000:]

def test_sparse_idx_changed_through_a_numpy_view_is_checked_again():
    """logZ checks idx once per tensor and version; a write through a numpy view leaves the version as it was, so a CPU
    idx is also compared with the copy checked: a state past C is refused, not read."""
    C, NZ = 8, 3
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(C, generator=g)[:NZ] for _ in range(C)])
    Ms, v0, vT = torch.randn(5, 2, C, NZ, generator=g), torch.zeros(2, C), torch.zeros(2, C)
    before = sparse.logZ(Ms, idx, v0, vT)
    version = idx._version
    idx.numpy()[0, 0] = 1000
    assert idx._version == version
    with pytest.raises(ValueError, match=r"idx must hold states in \[0, C\) = \[0, 8\), got values in \[0, 1000\]"):
        sparse.logZ(Ms, idx, v0, vT)
    idx.numpy()[0, 0] = (idx[0, 1] + 1) % C if (idx[0, 1] + 1) % C not in idx[0, 1:] else (idx[0, 2] + 1) % C
    changed = sparse.logZ(Ms, idx, v0, vT)                   # a valid change is read as it is now, not as cached
    assert torch.allclose(changed, sparse.logZ_reference(Ms, idx, v0, vT), rtol=1e-5)

from seqdist.ctc import ctc_loss

def ctc_case():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(10, 3, 5, generator=g, dtype=torch.float64).log_softmax(2)
    return lp, torch.tensor([[1, 2, 3], [2, 2, 4], [1, 1, 1]]), torch.tensor([10, 10, 8]), torch.full((3,), 3)

# where the non-finite score goes: (frame, sequence, class); sequence 1's targets are 2 2 4, sequence 2 has 8 frames
POISONS = {'NaN on a label': ((4, 1, 2), float('nan')), '+inf on a label': ((4, 1, 2), float('inf')),
           'NaN on the blank': ((0, 1, 0), float('nan')), 'NaN on a class no label reads': ((4, 1, 3), float('nan')),
           'NaN in the padding': ((9, 2, 1), float('nan')), 'nothing': (None, None)}

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
@pytest.mark.parametrize('zero_infinity', [False, True])
@pytest.mark.parametrize('poison', sorted(POISONS))
def test_ctc_nan_in_nan_out_as_pytorch(poison, zero_infinity, backend):
    """PyTorch's semantics: a NaN or +inf that a sequence's lattice reads makes its loss and gradient NaN, and
    zero_infinity (which zeroes the +inf of infeasible targets) leaves it NaN, so that a mixed-precision scaler sees
    it; a NaN where the lattice does not read is a NaN in that gradient entry only (exp(log_probs)), or nothing at all
    past the input length. (The kernels once returned +inf, and 0 with zero_infinity.)"""
    lp, tg, il, tl = ctc_case()
    at, value = POISONS[poison]
    if at is not None: lp[at] = value
    x = lp.clone().requires_grad_()
    for reduction in ('none', 'mean'):
        ours = ctc_loss(x, tg, il, tl, reduction=reduction, zero_infinity=zero_infinity, backend=backend)
        theirs = torch.nn.functional.ctc_loss(x, tg, il, tl, reduction=reduction, zero_infinity=zero_infinity)
        g_ours, = torch.autograd.grad(ours.sum(), x)
        g_theirs, = torch.autograd.grad(theirs.sum(), x)
        assert torch.allclose(ours, theirs, rtol=1e-9, equal_nan=True), (ours, theirs)
        assert torch.equal(g_ours.isnan(), g_theirs.isnan())
        assert torch.allclose(g_ours.nan_to_num(0), g_theirs.nan_to_num(0), atol=1e-9)

def test_ctc_nan_under_torch_compile():
    lp, tg, il, tl = ctc_case()
    lp[4, 1, 2] = float('nan')
    compiled = torch.compile(lambda x: ctc_loss(x, tg, il, tl, reduction='none', zero_infinity=True), fullgraph=True,
                             backend='aot_eager')
    assert torch.equal(compiled(lp).isnan(), torch.tensor([False, True, False]))

def _exact_ctc(lp, target):
    """logZ and the alignment entropy of one sequence (lp (T, C)) by enumeration, a mask of -1e30 taken for the -inf it
    stands for (a path through one has no weight): what float64 sums of -1e30 beside ordinary scores also give."""
    import itertools
    T, C = lp.shape
    scores = [sum(lp[t, a[t]].item() for t in range(T)) for a in itertools.product(range(C), repeat=T)
              if [k for k, _ in itertools.groupby(a) if k != 0] == target and all(lp[t, a[t]] > -1e29 for t in range(T))]
    s = torch.tensor(scores, dtype=torch.float64)
    logz = s.logsumexp(0)
    return logz, -((s - logz).exp() * (s - logz)).sum()

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_ctc_huge_scores_masks_are_exact_and_a_huge_log_prob_stands_for_inf(backend):
    """-1e30 (a mask) acts as the -inf it stands for: loss and entropy are the enumeration's. A log-probability of 1e30
    is none: taken for a number it swallowed every other term of its paths (entropy 1.68 where the paths through it have
    1.29, forced_align not their best path); it now stands for +inf, as PyTorch's +inf: that sequence NaN, the others
    exact, the alignment calls refuse it by name."""
    from seqdist.ctc import ctc_loss, alignment_entropy, forced_align
    from seqdist.checks import HUGE_LOG_PROB
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(5, 2, 3, generator=g, dtype=torch.float64).log_softmax(-1)
    lp[1, :, 2] = lp[3, 1, 1] = -1e30                                  # masks in both sequences
    lp[3, 0, 0] = 1e30                                                 # a huge log-probability in sequence 0
    tg, il, tl = torch.tensor([[1, 2], [1, 2]]), torch.tensor([5, 5]), torch.tensor([2, 2])
    logz, entropy = _exact_ctc(lp[:, 1], [1, 2])
    loss = ctc_loss(lp, tg, il, tl, reduction='none', backend=backend)
    assert loss[0].isnan() and torch.allclose(loss[1], -logz, rtol=1e-12)
    h = alignment_entropy(lp, tg, il, tl, reduction='none', backend=backend)
    assert h[0].isnan() and torch.allclose(h[1], entropy, rtol=1e-9)
    with pytest.raises(ValueError, match=r"log_probs of sequence 0 hold NaN or \+inf \(or a log-probability of 10000"):
        forced_align(lp[:, :1].transpose(0, 1), tg[:1], il[:1], tl[:1])
    lp[3, 0, 0] = HUGE_LOG_PROB / 2                                    # large, but a number: kept
    assert ctc_loss(lp, tg, il, tl, reduction='none', backend=backend).isfinite().all()
