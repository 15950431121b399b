"""PyTorch's non-finite semantics on every family (issue: bad input never lies). A NaN or a +inf where a sequence's
lattice reads its scores makes that sequence's loss or question NaN, and its gradient NaN, on every backend alike, while
the other sequences' values and gradients are exactly those of the clean batch; a NaN outside the lengths is padding,
never read. The alignment calls refuse a NaN by naming the sequence."""
import math
import pytest, torch
from seqdist import rnnt, tdt, ctc, joint, ctc_simple, sparse
from seqdist.crf import CTC_CRF

N, T, U, C = 3, 6, 3, 5
BACKENDS = ('cpu', 'cuda', 'reference')      # 'cuda' on CPU tensors: the CUDA source through the emulator

def _inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    y = torch.randint(1, C, (N, U), generator=g)
    y[1] = torch.tensor([3, 1, 2])           # label 3 in sequence 1: the CTC position (2, 1, 3) is on its lattice
    crf = CTC_CRF(state_len=2, alphabet='NACGT')
    sparse_idx = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(6)])
    return dict(y=y, il=torch.full((N,), T), tl=torch.full((N,), U), x4=r(N, T, U + 1, C), x9=r(N, T, U + 1, C + 5),
                xm=r(N, T, U + 1, C + 3), lp=r(T, N, C).log_softmax(-1), crf=crf, sc=r(T, N, crf.n_score()),
                yc=torch.randint(1, 5, (N, U), generator=g), enc=r(N, T, 4), pred=r(N, U + 1, 4), W=r(C, 4),
                st=r(T, N, U + 1), mv=r(T, N, U), Ms=r(T, N, 6, 3), idx=sparse_idx, ends=torch.zeros(N, 6, dtype=torch.float64))

I = _inputs()
# name: (call(backend, *differentiable inputs), the differentiable inputs' names, their sequence dimension, where the
# bad score goes in the first, the backends)
CASES = {
    'rnnt_loss': (lambda b, x: rnnt.rnnt_loss(x, I['y'], I['il'], I['tl'], blank=0, reduction='none', backend=b),
                  ['x4'], [0], (1, 2, 1, 3), BACKENDS),
    'rnnt_loss unfused': (lambda b, x: rnnt.rnnt_loss(x.log_softmax(-1), I['y'], I['il'], I['tl'], blank=0,
                                                      reduction='none', fused_log_softmax=False, backend=b),
                          ['x4'], [0], (1, 2, 1, 3), BACKENDS),
    'rnnt entropy': (lambda b, x: rnnt.alignment_entropy(x, I['y'], I['il'], I['tl'], blank=0, backend=b),
                     ['x4'], [0], (1, 2, 1, 3), BACKENDS),
    'rnnt kl (p)': (lambda b, p, q: rnnt.alignment_kl(p, q, I['y'], I['il'], I['tl'], blank=0, backend=b),
                    ['x4', 'x4'], [0, 0], (1, 2, 1, 3), BACKENDS),
    'rnnt cross_entropy (p)': (lambda b, p, q: rnnt.alignment_cross_entropy(p, q, I['y'], I['il'], I['tl'], blank=0,
                                                                            backend=b), ['x4', 'x4'], [0, 0], (1, 2, 1, 3), BACKENDS),
    'tdt_loss': (lambda b, x: tdt.tdt_loss(x, I['y'], I['il'], I['tl'], blank=0, reduction='none', backend=b),
                 ['x9'], [0], (1, 2, 1, 3), BACKENDS),
    'tdt entropy': (lambda b, x: tdt.alignment_entropy(x, I['y'], I['il'], I['tl'], blank=0, backend=b),
                    ['x9'], [0], (1, 2, 1, 3), BACKENDS),
    'tdt kl (q)': (lambda b, q, p: tdt.alignment_kl(p, q, I['y'], I['il'], I['tl'], blank=0, backend=b),
                   ['x9', 'x9'], [0, 0], (1, 2, 1, 3), BACKENDS),
    'multiblank_rnnt_loss': (lambda b, x: tdt.multiblank_rnnt_loss(x, I['y'], I['il'], I['tl'], big_blank_durations=(2, 4),
                                                                   blank=C + 2, reduction='none', backend=b),
                             ['xm'], [0], (1, 2, 1, 3), BACKENDS),
    'multiblank entropy': (lambda b, x: tdt.multiblank_alignment_entropy(x, I['y'], I['il'], I['tl'],
                                                                         big_blank_durations=(2, 4), blank=C + 2, backend=b),
                           ['xm'], [0], (1, 2, 1, 3), BACKENDS),
    'joint_rnnt_loss': (lambda b, e, p, w: joint.joint_rnnt_loss(e, p, w, I['y'], I['il'], I['tl'], blank=0,
                                                                 reduction='none', backend=b),
                        ['enc', 'pred', 'W'], [0, 0, None], (1, 2, 1), BACKENDS),
    'ctc_loss': (lambda b, x: ctc.ctc_loss(x, I['y'], I['il'], I['tl'], reduction='none', backend=b),
                 ['lp'], [1], (2, 1, 3), BACKENDS),
    'ctc_loss zero_infinity': (lambda b, x: ctc.ctc_loss(x, I['y'], I['il'], I['tl'], reduction='none',
                                                         zero_infinity=True, backend=b), ['lp'], [1], (2, 1, 3), BACKENDS),
    'ctc entropy': (lambda b, x: ctc.alignment_entropy(x, I['y'], I['il'], I['tl'], backend=b), ['lp'], [1], (2, 1, 3), BACKENDS),
    'ctc kl (p)': (lambda b, p, q: ctc.alignment_kl(p, q, I['y'], I['il'], I['tl'], backend=b), ['lp', 'lp'], [1, 1],
                   (2, 1, 3), BACKENDS),
    'ctc kl (q)': (lambda b, q, p: ctc.alignment_kl(p, q, I['y'], I['il'], I['tl'], backend=b), ['lp', 'lp'], [1, 1],
                   (2, 1, 3), BACKENDS),
    'CTC_CRF.ctc_loss': (lambda b, s: I['crf'].ctc_loss(s, I['yc'], I['tl'], reduction='none'), ['sc'], [1], (2, 1, 5), ('auto',)),
    'CTC_CRF.logZ': (lambda b, s: I['crf'].logZ(s), ['sc'], [1], (2, 1, 5), ('auto',)),
    'CTC_CRF.entropy': (lambda b, s: I['crf'].entropy(s, backend=b), ['sc'], [1], (2, 1, 5), BACKENDS),
    'CTC_CRF.kl (p)': (lambda b, p, q: I['crf'].kl(p, q, backend=b), ['sc', 'sc'], [1, 1], (2, 1, 5), BACKENDS),
    'stay/move logZ': (lambda b, s, m: ctc_simple.logZ(s, m, I['tl'], backend=b), ['st', 'mv'], [1, 1], (2, 1, 1), BACKENDS),
    'sparse logZ': (lambda b, m: sparse.logZ(m, I['idx'], I['ends'], I['ends'], backend=b), ['Ms'], [1], (2, 1, 1, 1),
                    ('cpu', 'reference')),
}

def _run(name, backend, bad=None):
    call, names, _, at, _ = CASES[name]
    xs = [I[n].clone() for n in names]
    if len(names) == 2 and names[0] == names[1]: xs[1] = xs[1] * 0.9      # the other side of a KL: another model
    if bad is not None: xs[0][at] = bad
    xs = [x.requires_grad_() for x in xs]
    value = call(backend, *xs)
    value.sum().backward()
    return value.detach(), [x.grad for x in xs]

def _seq(g, dim, n): return g if dim is None else g.select(dim, n)

@pytest.mark.parametrize('bad', [math.nan, math.inf], ids=['nan', '+inf'])
@pytest.mark.parametrize('name,backend', [(n, b) for n, c in CASES.items() for b in c[4]])
def test_a_nonfinite_score_makes_its_sequence_nan_and_leaves_the_others_exact(name, backend, bad):
    _, _, dims, _, _ = CASES[name]
    clean_value, clean_grads = _run(name, backend)
    value, grads = _run(name, backend, bad)
    assert torch.isfinite(clean_value).all()
    assert value[1].isnan(), f"{name}: the poisoned sequence's value is {value[1].item()}, not NaN"
    for g, dim in zip(grads, dims):
        assert _seq(g, dim, 1).isnan().any(), f"{name}: no NaN in the poisoned sequence's gradient"
    if name == 'joint_rnnt_loss': return            # the weight's gradient sums over every sequence: NaN for all
    for n in (0, 2):
        assert torch.equal(value[n], clean_value[n])
        for g, cg, dim in zip(grads, clean_grads, dims): assert torch.equal(_seq(g, dim, n), _seq(cg, dim, n))

@pytest.mark.parametrize('name', ['rnnt_loss', 'tdt_loss', 'ctc_loss', 'rnnt entropy', 'ctc entropy', 'stay/move logZ'])
def test_a_nan_past_the_lengths_is_padding(name):
    "Sequence 1 one frame and one label shorter: a NaN in its last frame is never read, on any backend."
    global I
    keep = dict(I)
    try:
        I['il'], I['tl'] = torch.tensor([T, T - 1, T]), torch.tensor([U, U - 1, U])
        at = {'lp': (T - 1, 1, 0), 'st': (T - 1, 1, 0) if False else (0, 1, U)}.get(CASES[name][1][0], (1, T - 1, 0, 0))
        for backend in CASES[name][4]:
            clean_value, clean_grads = _run(name, backend)
            CASES_AT = CASES[name]
            CASES[name] = (*CASES_AT[:3], at, CASES_AT[4])
            try: value, grads = _run(name, backend, math.nan)
            finally: CASES[name] = CASES_AT
            assert torch.equal(value, clean_value), (backend, value, clean_value)
            for g, cg in zip(grads, clean_grads): assert torch.equal(g, cg)
    finally: I = keep

ALIGNMENT_CALLS = {
    'ctc.forced_align': lambda b, d: ctc.forced_align(d['lp'].transpose(0, 1), d['y'], d['il'], d['tl'], backend=b),
    'ctc.kbest_alignments': lambda b, d: ctc.kbest_alignments(d['lp'], d['y'], d['il'], d['tl'], backend=b),
    'ctc.sample_alignments': lambda b, d: ctc.sample_alignments(d['lp'], d['y'], d['il'], d['tl'], backend=b),
    'rnnt.best_path': lambda b, d: rnnt.best_path(d['x4'], d['y'], d['il'], d['tl'], blank=0, backend=b),
    'rnnt.kbest_alignments': lambda b, d: rnnt.kbest_alignments(d['x4'], d['y'], d['il'], d['tl'], blank=0, backend=b),
    'tdt.tdt_best_path': lambda b, d: tdt.tdt_best_path(d['x9'], d['y'], d['il'], d['tl'], blank=0, backend=b),
    'tdt.kbest_alignments': lambda b, d: tdt.kbest_alignments(d['x9'], d['y'], d['il'], d['tl'], blank=0, backend=b),
    'tdt.sample_alignments': lambda b, d: tdt.sample_alignments(d['x9'], d['y'], d['il'], d['tl'], blank=0, backend=b),
    'CTC_CRF.viterbi': lambda b, d: d['crf'].viterbi(d['sc']),
    'CTC_CRF.ctc_viterbi_alignments': lambda b, d: d['crf'].ctc_viterbi_alignments(d['sc'], d['yc'], d['tl']),
    'CTC_CRF.sample': lambda b, d: d['crf'].sample(d['sc'], backend=b),
    'CTC_CRF.kbest': lambda b, d: d['crf'].kbest(d['sc'], backend=b),
    'ctc_simple.viterbi_alignments': lambda b, d: ctc_simple.viterbi_alignments(d['st'], d['mv'], d['tl'], backend=b),
}
NAN_AT = {'lp': (2, 1, 3), 'x4': (1, 2, 1, 3), 'x9': (1, 2, 1, 3), 'sc': (2, 1, 5), 'st': (2, 1, 1)}
NAME = {'lp': 'log_probs', 'x4': 'logits', 'x9': 'logits', 'sc': 'scores', 'st': 'stay_scores or move_scores'}

@pytest.mark.parametrize('bad', [math.nan, math.inf], ids=['nan', '+inf'])
@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('call', sorted(ALIGNMENT_CALLS))
def test_the_alignment_calls_refuse_nan_naming_the_sequence(call, backend, bad):
    "NaN, and +inf (on which the backends' best paths disagreed), have no best path, k-best list or sample."
    d = dict(I)
    for key, at in NAN_AT.items():
        d[key] = d[key].clone()
        d[key][at] = bad
    ALIGNMENT_CALLS[call](backend, I)                              # the clean inputs: an answer
    with pytest.raises(ValueError, match=r"of sequence 1 hold NaN or \+inf( \(or a log-probability of 10000 or more, which stands for \+inf\))? within its lengths"):
        ALIGNMENT_CALLS[call](backend, d)

@pytest.mark.parametrize('bad', [math.nan, math.inf], ids=['nan', '+inf'])
@pytest.mark.parametrize('where', ['Ms', 'v0', 'vT', 'CTC-CRF loss'])
def test_the_sparse_cuda_path_flags_what_it_reads(where, bad):
    """The CUDA path of sparse logZ (Log; the emulator on CPU tensors) finds a NaN or +inf among Ms, v0 and vT in its
    forward recursion, as it reads them (no pass of PyTorch operations): the poisoned sequence's logZ and gradient all
    NaN, the others' exactly those of the clean batch. Also the CTC-CRF loss's op through it (normalised_target_logp)."""
    from seqdist.crf import normalised_target_logp
    crf, g = I['crf'], torch.Generator().manual_seed(5)
    C, NZ = crf.idx.shape
    Ms, ends = torch.randn(T, N, C, NZ, generator=g, dtype=torch.float64), torch.zeros(N, C, dtype=torch.float64)
    def run(poison):
        xs = dict(Ms=Ms.clone(), v0=ends.clone(), vT=ends.clone())
        at = {'v0': (1, 3), 'vT': (1, 3)}.get(where, (2, 1, 3, 1))
        if poison: xs['Ms' if where == 'CTC-CRF loss' else where][at] = bad
        M = xs['Ms'].requires_grad_()
        if where == 'CTC-CRF loss':
            scores = M.reshape(T, N, C * NZ)
            cols, n = crf._target_columns(scores, I['yc'])
            value = normalised_target_logp(scores, cols, I['tl'] + 1 - crf.state_len, crf.idx, n, backend='cuda')[0]
        else: value = sparse.logZ(M, crf.idx, xs['v0'], xs['vT'], backend='cuda')
        return value.detach(), torch.autograd.grad(value.sum(), M)[0]
    (v0, g0), (v1, g1) = run(False), run(True)
    assert torch.isfinite(v0).all() and v1[1].isnan() and g1[:, 1].isnan().all()
    for n in (0, 2): assert torch.equal(v1[n], v0[n]) and torch.equal(g1[:, n], g0[:, n])

@pytest.mark.parametrize('at', [(0, 1, 2), (T - 1, 1, 3), (0, 1, 0), (T - 1, 1, 1)], ids=['t0-last-label', 'tT-first-label', 't0-blank', 'tT-blank'])
def test_ctc_questions_cuda_kernel_finds_poison_outside_the_band(at):
    """The CTC entropy/KL kernel looks for NaN at every frame and state of the lattice, not only the band it sums over
    (at frame 0 the last label, at the last frame the first: no path reads them): as `poisoned_sequences` on the CPU,
    the sequence's value and gradient NaN, the others' those of the CPU kernel."""
    y = I['y'][1]
    assert at[2] in (0, *y.tolist())                   # a class sequence 1's lattice has
    got = {}
    for backend in ('cpu', 'cuda'):
        lp, lq = I['lp'].clone(), I['lp'].clone() * 0.9
        lp[at] = math.nan
        lp.requires_grad_()
        v = ctc.alignment_kl(lp, lq, I['y'], I['il'], I['tl'], backend=backend)
        got[backend] = (v.detach(), torch.autograd.grad(v.sum(), lp)[0])
    for v, g in got.values(): assert v[1].isnan() and g[:, 1].isnan().all()
    for n in (0, 2):
        torch.testing.assert_close(got['cuda'][0][n], got['cpu'][0][n], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got['cuda'][1][:, n], got['cpu'][1][:, n], rtol=1e-10, atol=1e-12)
