"""TDT and multi-blank transducers: the reference equals brute-force enumeration (Log and Max) and a re-derivation of
NeMo's recursion; the multi-blank lattice without big blanks is the RNN-T's; the op's three paths (reference, numba,
CUDA source in the emulator) agree, pass gradcheck, and implement sigma, omega, FastEmit, clamp and the delay penalty
as stated; bad inputs, torch.compile, low precision, alignments."""
import math, random, pytest, torch
import seqdist.tdt as tdt
import seqdist.benchmarks.tdt as tdt_benchmarks
from seqdist.core import Log, Max
from seqdist.rnnt import clean_targets, edge_log_probs, logz_reference as rnnt_logz_reference
from seqdist.tdt import edge_table, edge_scores, logz_reference, tdt_brute_force, multiblank_brute_force

DURATION_SETS = [(0, 1, 2, 3, 4), (0, 1, 2), (0, 1, 2, 3, 4, 5, 6, 7, 8), (1, 2), (0, 1), (1,)]

def random_tdt(rng, durations=None, dtype=torch.float64, max_B=3, max_T=7, max_U=4, max_V=6, scale=None):
    "Random logits (B, T, U+1, V + D), targets with garbage padding, variable lengths, a blank anywhere."
    durations = durations or rng.choice(DURATION_SETS)
    B, T, U, V = rng.randint(1, max_B), rng.randint(1, max_T), rng.randint(0, max_U), rng.randint(2, max_V)
    blank = rng.choice([-1, V - 1, 0, rng.randrange(V)])
    b = blank % V
    labels = [c for c in range(V) if c != b]
    y = torch.tensor([[rng.choice(labels) for _ in range(U)] for _ in range(B)], dtype=torch.int64).view(B, U)
    tl = torch.tensor([rng.randint(0, U) for _ in range(B)])
    il = torch.tensor([rng.randint(1, T) for _ in range(B)])
    pad = torch.arange(U)[None] >= tl[:, None]
    y = torch.where(pad, torch.randint(-5, V + 5, y.shape), y)
    x = (torch.randn(B, T, U + 1, V + len(durations), dtype=torch.float64) * (scale or rng.choice([1.0, 3.0]))).to(dtype)
    return x, y, il, tl, durations, blank

def random_multiblank(rng, big=None, dtype=torch.float64, max_B=3, max_T=7, max_U=4, max_V=7):
    big = rng.choice([(), (2,), (2, 4), (3, 2, 5)]) if big is None else big
    B, T, U, V = rng.randint(1, max_B), rng.randint(1, max_T), rng.randint(0, max_U), rng.randint(len(big) + 2, max_V + len(big))
    blank = rng.choice([-1, V - 1, rng.randrange(len(big), V)])
    b = blank % V
    labels = [c for c in range(V) if not b - len(big) <= c <= b]
    y = torch.tensor([[rng.choice(labels) for _ in range(U)] for _ in range(B)], dtype=torch.int64).view(B, U)
    tl = torch.tensor([rng.randint(0, U) for _ in range(B)])
    il = torch.tensor([rng.randint(1, T) for _ in range(B)])
    x = torch.randn(B, T, U + 1, V, dtype=torch.float64).to(dtype)
    return x, y, il, tl, big, blank

def tdt_parts(x, y, il, tl, durations, blank):
    "Token and duration log-probs, the padded targets and lengths (blank in [0, V))."
    V = x.shape[-1] - len(durations)
    yc, ilc, tlc = clean_targets(x[..., :V], y, il, tl, blank % V)
    return x[..., :V].log_softmax(-1), x[..., V:].log_softmax(-1), yc, ilc, tlc, blank % V

def same_logz(a, b, tol=1e-10):
    if a <= -1e30 or b == -math.inf: return a <= -1e30 and b == -math.inf
    return abs(a - b) <= tol * max(1.0, abs(b))

@pytest.mark.parametrize('S', [Log, Max])
def test_tdt_reference_equals_brute_force(S):
    rng = random.Random(0)
    for _ in range(40):
        x, y, il, tl, durations, blank = random_tdt(rng, max_T=5, max_U=3, max_V=5)
        lp, dlp, yc, ilc, tlc, blank = tdt_parts(x, y, il, tl, durations, blank)
        table = edge_table(durations, (), blank, False)
        ref = logz_reference(edge_scores(lp, dlp, yc, table), table, ilc, tlc, S)
        for b in range(x.shape[0]):
            Tb, Ub = int(il[b]), int(tl[b])
            bf = tdt_brute_force(lp[b, :Tb, :Ub + 1], dlp[b, :Tb, :Ub + 1], yc[b].tolist(), durations, blank, S)
            assert same_logz(ref[b].item(), bf.item()), (durations, Tb, Ub, ref[b].item(), bf.item())

@pytest.mark.parametrize('S', [Log, Max])
def test_multiblank_reference_equals_brute_force(S):
    rng = random.Random(1)
    for _ in range(40):
        x, y, il, tl, big, blank = random_multiblank(rng, max_T=6, max_U=3)
        V = x.shape[-1]
        yc, ilc, tlc = clean_targets(x, y, il, tl, blank % V)
        lp = x.log_softmax(-1)
        table = edge_table((), big, blank % V, False)
        ref = logz_reference(edge_scores(lp, None, yc, table), table, ilc, tlc, S)
        for b in range(x.shape[0]):
            Tb, Ub = int(il[b]), int(tl[b])
            bf = multiblank_brute_force(lp[b, :Tb, :Ub + 1], yc[b].tolist(), big, blank % V, S)
            assert same_logz(ref[b].item(), bf.item()), (big, Tb, Ub, ref[b].item(), bf.item())

@pytest.mark.parametrize('S', [Log, Max])
def test_multiblank_without_big_blanks_is_the_rnnt_lattice(S):
    rng = random.Random(2)
    for _ in range(20):
        x, y, il, tl, _, blank = random_multiblank(rng, big=(), max_T=9, max_U=5)
        V = x.shape[-1]
        yc, ilc, tlc = clean_targets(x, y, il, tl, blank % V)
        table = edge_table((), (), blank % V, False)
        ours = logz_reference(edge_scores(x.log_softmax(-1), None, yc, table), table, ilc, tlc, S)
        torch.testing.assert_close(ours, rnnt_logz_reference(*edge_log_probs(x, yc, blank % V), ilc, tlc, S), rtol=1e-12, atol=1e-12)

def nemo_tdt_logz(token_lp, duration_lp, y, T, U, durations, blank, sigma):
    """NeMo's TDT recursion (TDTLossPytorch.compute_forward_prob), re-derived: frame by frame, node by node, each node
    summing its incoming blank edges (d >= 1) and label edges (any d); the end sums the blanks that land on T."""
    def lse(terms): return torch.logsumexp(torch.stack(terms), 0) if terms else token_lp.new_tensor(-math.inf)
    alpha = {}
    for t in range(T):
        for u in range(U + 1):
            if t == 0 and u == 0: alpha[t, u] = token_lp.new_zeros(()); continue
            terms = []
            for i, d in enumerate(durations):
                if t - d < 0: continue
                if d > 0: terms.append(alpha[t - d, u] + token_lp[t - d, u, blank] - sigma + duration_lp[t - d, u, i])
                if u > 0: terms.append(alpha[t - d, u - 1] + token_lp[t - d, u - 1, y[u - 1]] - sigma + duration_lp[t - d, u - 1, i])
            alpha[t, u] = lse(terms)
    return lse([alpha[T - d, U] + token_lp[T - d, U, blank] - sigma + duration_lp[T - d, U, i]
                for i, d in enumerate(durations) if d > 0 and T - d >= 0])

def test_reference_equals_nemo_recursion_with_sigma():
    rng = random.Random(3)
    for durations in [(0, 1, 2, 3, 4), (0, 1, 2), (0, 1, 2, 3, 4, 5, 6, 7, 8)]:
        for _ in range(6):
            x, y, il, tl, durations, blank = random_tdt(rng, durations, max_T=12, max_U=5)
            sigma = rng.choice([0.0, 0.05, 0.5])
            lp, dlp, yc, ilc, tlc, blank = tdt_parts(x, y, il, tl, durations, blank)
            table = edge_table(durations, (), blank, False)
            ref = logz_reference(edge_scores(lp, dlp, yc, table, (sigma, 0.0)), table, ilc, tlc)
            for b in range(x.shape[0]):
                nemo = nemo_tdt_logz(lp[b], dlp[b], yc[b].tolist(), int(il[b]), int(tl[b]), durations, blank, sigma)
                assert same_logz(ref[b].item(), nemo.item()), (durations, ref[b].item(), nemo.item())

def monotonic_rnnt_logz(token_lp, y, T, U, blank):
    """One symbol per frame, blank or the next label (the monotonic RNN-T), the last frame's a blank: alpha[t + 1, u] from
    alpha[t, u] and alpha[t, u - 1]."""
    alpha = torch.full((T + 1, U + 1), -math.inf, dtype=token_lp.dtype)
    alpha[0, 0] = 0
    for t in range(T - 1):
        for u in range(U + 1):
            a = alpha[t, u] + token_lp[t, u, blank]
            if u > 0: a = torch.logaddexp(a, alpha[t, u - 1] + token_lp[t, u - 1, y[u - 1]])
            alpha[t + 1, u] = a
    return alpha[T - 1, U] + token_lp[T - 1, U, blank]

def test_durations_one_only_is_the_monotonic_rnnt():
    """With durations (1,) every symbol, blank or label, moves one frame (the duration softmax has one column: log 1 = 0):
    the TDT lattice is the monotonic RNN-T's, one symbol per frame, whose last frame emits a blank."""
    rng = random.Random(4)
    for _ in range(15):
        x, y, il, tl, durations, blank = random_tdt(rng, (1,), max_T=8, max_U=4)
        lp, dlp, yc, ilc, tlc, blank = tdt_parts(x, y, il, tl, durations, blank)
        table = edge_table(durations, (), blank, False)
        ref = logz_reference(edge_scores(lp, dlp, yc, table), table, ilc, tlc)
        for b in range(x.shape[0]):
            mono = monotonic_rnnt_logz(lp[b], yc[b].tolist(), int(il[b]), int(tl[b]), blank)
            assert same_logz(ref[b].item(), mono.item()), (ref[b].item(), mono.item())

def test_reference_gradcheck_of_logz():
    torch.manual_seed(0)
    durations = (0, 1, 2)
    x = torch.randn(2, 3, 3, 4 + 3, dtype=torch.float64, requires_grad=True)
    y, il, tl = torch.tensor([[1, 2], [0, 3]]), torch.tensor([3, 2]), torch.tensor([2, 1])
    table = edge_table(durations, (), 3, True)
    def f(x):
        lp, dlp = x[..., :4].log_softmax(-1), x[..., 4:].log_softmax(-1)
        s = edge_scores(lp, dlp, torch.nn.functional.pad(y, (0, 1), value=3), table, (0.1, 0.0), tdt.delay_offsets(il, 3, 0.3))
        return torch.stack([logz_reference(s, table, il, tl, Log, lat) for lat in (0, 1)])
    assert torch.autograd.gradcheck(f, (x,))

# ---------------------------------------------------------------------------------------------------------------------
# The op and the public API
from seqdist.tdt import tdt_loss, multiblank_rnnt_loss, TDTLoss, MultiblankRNNTLoss, delay_offsets
from seqdist.rnnt import rnnt_loss
from seqdist.utils import emulator_options

BACKENDS = ['reference', 'cpu', 'cuda']

def loss_and_grad(f, x, *args, **kw):
    x = x.detach().requires_grad_()
    loss = f(x, *args, **kw)
    w = torch.arange(1, loss.numel() + 1, dtype=loss.dtype).view(loss.shape)      # a weight per sequence for 'none'
    return loss.detach(), torch.autograd.grad((loss * w).sum(), x)[0]

def tdt_lg(x, y, il, tl, durations, blank, **kw): return loss_and_grad(tdt_loss, x, y, il, tl, durations, blank, **kw)

TOL64, TOL32, TOL32_REF = dict(rtol=1e-9, atol=1e-12), dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-4, atol=1e-4)

def assert_same(a, b, rtol, atol): torch.testing.assert_close(a, b.to(a.dtype), rtol=rtol, atol=atol)

def three_paths(f, x, *args, backends=None, **kw):
    "Every backend against the float64 reference: values, gradients (in the input's dtype)."
    truth = loss_and_grad(f, x.double(), *args, backend='reference', **kw)
    for backend in backends or BACKENDS:
        tol = TOL64 if x.dtype == torch.float64 else TOL32_REF if backend == 'reference' else TOL32
        out = loss_and_grad(f, x, *args, backend=backend, **kw)
        assert out[0].dtype == out[1].dtype == x.dtype, backend
        assert_same(out[0], truth[0], **tol); assert_same(out[1], truth[1], **tol)

def random_options(rng, tdt=True):
    kw = dict(reduction=rng.choice(['none', 'sum', 'mean', 'mean_volume']), sigma=rng.choice([0.0, 0.05]),
              clamp=rng.choice([-1, -1, 0.05]), fastemit_lambda=rng.choice([0.0, 0.01]), delay_penalty=rng.choice([0.0, 0.0, 0.3]))
    if tdt: kw['omega'] = rng.choice([0.0, 0.0, 0.1, 1.0])
    return kw

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_tdt_three_paths_agree_on_random_cases(dtype):
    "Variable lengths, garbage padding, any blank, every option and reduction; U = 0 and T = 1 occur."
    rng = random.Random(10 if dtype == torch.float64 else 11)
    for case in range(14):
        x, y, il, tl, durations, blank = random_tdt(rng, dtype=dtype)
        with emulator_options(seed=case):
            three_paths(tdt_loss, x, y, il, tl, durations, blank, **random_options(rng))

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_multiblank_three_paths_agree_on_random_cases(dtype):
    rng = random.Random(12 if dtype == torch.float64 else 13)
    for case in range(12):
        x, y, il, tl, big, blank = random_multiblank(rng, dtype=dtype)
        with emulator_options(seed=case):
            three_paths(multiblank_rnnt_loss, x, y, il, tl, big, blank, **random_options(rng, tdt=False))

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
def test_gradcheck(backend):
    if backend not in BACKENDS: pytest.skip(f"{backend} not built yet")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 3, 5 + 3, dtype=torch.float64, requires_grad=True)
    y, il, tl = torch.tensor([[1, 2], [3, 0]]), torch.tensor([3, 2]), torch.tensor([2, 1])
    for kw in (dict(sigma=0.1, omega=0.4, delay_penalty=0.3),):
        assert torch.autograd.gradcheck(lambda x: tdt_loss(x, y, il, tl, (0, 1, 2), 4, reduction='none', backend=backend, **kw), (x,))
    xm = x[..., :6].detach().requires_grad_()
    ym = torch.tensor([[1, 2], [0, 2]])
    assert torch.autograd.gradcheck(lambda x: multiblank_rnnt_loss(x, ym, il, tl, (2, 3), reduction="none", sigma=0.1,
                                                                   backend=backend), (xm,))

def test_tdt_loss_equals_nemo_recursion_on_randomised_cases():
    "NeMo's recursion (re-derived) with variable lengths and sigma, durations [0..4], [0, 1, 2] and [0..8]: every backend."
    rng = random.Random(14)
    for durations in [(0, 1, 2, 3, 4), (0, 1, 2), (0, 1, 2, 3, 4, 5, 6, 7, 8)]:
        for _ in range(4):
            x, y, il, tl, durations, blank = random_tdt(rng, durations, max_T=14, max_U=5)
            sigma = rng.choice([0.0, 0.05, 0.3])
            lp, dlp, yc, ilc, tlc, b = tdt_parts(x, y, il, tl, durations, blank)
            nemo = torch.stack([nemo_tdt_logz(lp[i], dlp[i], yc[i].tolist(), int(il[i]), int(tl[i]), durations, b, sigma)
                                for i in range(x.shape[0])])
            for backend in BACKENDS:
                ours = tdt_loss(x, y, il, tl, durations, blank, sigma=sigma, reduction='none', backend=backend)
                torch.testing.assert_close(ours, -nemo, rtol=1e-10, atol=1e-10)

def test_multiblank_without_big_blanks_equals_rnnt_loss():
    "Values and gradients, clamp and FastEmit included: the multi-blank loss with no big blanks is our rnnt_loss."
    rng = random.Random(15)
    for _ in range(8):
        x, y, il, tl, _, blank = random_multiblank(rng, big=(), max_T=9, max_U=5)
        kw = dict(reduction=rng.choice(['none', 'sum', 'mean']), clamp=rng.choice([-1, 0.05]), fastemit_lambda=rng.choice([0.0, 0.01]))
        want = loss_and_grad(rnnt_loss, x, y, il, tl, blank, **kw)
        for backend in BACKENDS:
            got = loss_and_grad(multiblank_rnnt_loss, x, y, il, tl, [], blank, backend=backend, **kw)
            assert_same(got[0], want[0], **TOL64); assert_same(got[1], want[1], **TOL64)

def test_omega_is_the_expectation_of_nemos_draw():
    "omega: (1 - omega) TDT (with sigma) + omega RNN-T of the token logits (no sigma), in value and gradient."
    rng = random.Random(16)
    for _ in range(6):
        x, y, il, tl, durations, blank = random_tdt(rng, (0, 1, 2, 3))
        omega, V = rng.choice([0.1, 0.5]), x.shape[-1] - 4
        for backend in BACKENDS:
            got = tdt_lg(x, y, il, tl, durations, blank, sigma=0.05, omega=omega, reduction='sum', backend=backend)
            t = tdt_lg(x, y, il, tl, durations, blank, sigma=0.05, reduction='sum', backend=backend)
            r = loss_and_grad(rnnt_loss, x[..., :V], y, il, tl, blank % V, reduction='sum')
            assert_same(got[0], (1 - omega) * t[0] + omega * r[0], **TOL64)
            assert_same(got[1], (1 - omega) * t[1] + omega * F.pad(r[1], (0, 4)), **TOL64)

import torch.nn.functional as F

def test_delay_penalty_equals_the_loss_on_shifted_log_probs():
    "k2's delay penalty: the loss (and gradient) of the same lattice with every label log-probability at frame t shifted."
    rng = random.Random(17)
    for _ in range(6):
        x, y, il, tl, durations, blank = random_tdt(rng, (0, 1, 2), max_T=9)
        dp = rng.choice([0.1, -0.2, 1.0])
        V = x.shape[-1] - len(durations)
        xg = x.detach().requires_grad_()
        lp, dlp, yc, ilc, tlc, b = tdt_parts(xg, y, il, tl, durations, blank)
        shift = delay_offsets(ilc, x.shape[1], dp)[:, :, None, None] * (torch.arange(V) != b)   # every non-blank token
        lp = lp + shift
        table = edge_table(durations, (), b, False)
        cost = -logz_reference(edge_scores(lp, dlp, yc, table), table, ilc, tlc)
        w = torch.arange(1, cost.numel() + 1, dtype=cost.dtype)
        want = cost.detach(), torch.autograd.grad((cost * w).sum(), xg)[0]
        for backend in BACKENDS:
            got = tdt_lg(x, y, il, tl, durations, blank, delay_penalty=dp, reduction='none', backend=backend)
            assert_same(got[0], want[0], **TOL64); assert_same(got[1], want[1], **TOL64)

def test_fastemit_equals_its_formula():
    """FastEmit: the loss is unchanged; the gradient is that of -log Z - lam * sum p_y(t, u) log p_tok(y_{u+1} | t, u),
    the label edges' posteriors p_y held fixed (so the duration logits' gradient is unscaled, as in NeMo)."""
    rng = random.Random(18)
    for _ in range(5):
        x, y, il, tl, durations, blank = random_tdt(rng, (0, 1, 2))
        lam = rng.choice([0.01, 0.5])
        lp0, dlp0, yc, ilc, tlc, b = tdt_parts(x, y, il, tl, durations, b_ := blank)
        table = edge_table(durations, (), b, False)
        post = torch.autograd.grad(logz_reference(edge_scores(lp0, dlp0, yc, table).requires_grad_(), table, ilc, tlc).sum()
                                   if False else 0, []) if False else None
        scores = edge_scores(lp0, dlp0, yc, table).requires_grad_()
        logz = logz_reference(scores, table, ilc, tlc)
        p = torch.autograd.grad(torch.where(logz <= -1e30, 0, logz).sum(), scores)[0]
        p_label = (p * torch.tensor(table[:, 1] == 1)).sum(-1)                   # (B, T, U+1)
        xg = x.detach().requires_grad_()
        lp, dlp, *_ = tdt_parts(xg, y, il, tl, durations, blank)
        e = lp.gather(3, yc[:, None, :, None].expand(*lp.shape[:3], 1))[..., 0]
        cost = -logz_reference(edge_scores(lp, dlp, yc, table), table, ilc, tlc)
        surrogate = cost.sum() - lam * (p_label * e).sum()
        want = torch.autograd.grad(surrogate, xg)[0]
        for backend in BACKENDS:
            l0, _ = tdt_lg(x, y, il, tl, durations, blank, reduction='sum', backend=backend)
            l1, g1 = tdt_lg(x, y, il, tl, durations, blank, reduction='sum', fastemit_lambda=lam, backend=backend)
            assert torch.equal(l0, l1)
            assert_same(g1, want, rtol=1e-9, atol=1e-11)

def test_clamp_clamps_each_token_element_before_the_incoming_gradient():
    torch.manual_seed(19)
    x = torch.randn(2, 6, 3, 4 + 3, dtype=torch.float64) * 3
    y, il, tl = torch.tensor([[1, 2], [2, 1]]), torch.tensor([6, 4]), torch.tensor([2, 2])
    for backend in BACKENDS:
        _, g = tdt_lg(x, y, il, tl, (0, 1, 2), 0, reduction='none', backend=backend)
        _, gc = tdt_lg(x, y, il, tl, (0, 1, 2), 0, reduction='none', clamp=0.05, backend=backend)
        w = torch.tensor([1.0, 2.0], dtype=torch.float64)[:, None, None, None]
        assert (g[..., :4].abs() > 0.05 * w).any() and (g[..., 4:].abs() > 0.05 * w).any()
        torch.testing.assert_close(gc[..., :4], (g[..., :4] / w).clamp(-0.05, 0.05) * w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gc[..., 4:], g[..., 4:], rtol=1e-12, atol=1e-12)     # durations: not clamped (NeMo)

def test_reductions():
    torch.manual_seed(20)
    x = torch.randn(3, 6, 4, 5 + 3)
    y, il, tl = torch.randint(0, 4, (3, 3)), torch.tensor([6, 5, 2]), torch.tensor([3, 1, 0])
    costs = tdt_loss(x, y, il, tl, (0, 1, 2), reduction='none')
    torch.testing.assert_close(tdt_loss(x, y, il, tl, (0, 1, 2), reduction='sum'), costs.sum())
    torch.testing.assert_close(tdt_loss(x, y, il, tl, (0, 1, 2)), costs.mean())
    torch.testing.assert_close(tdt_loss(x, y, il, tl, (0, 1, 2), reduction='mean_volume'), costs.sum() / 4)
    torch.testing.assert_close(tdt_loss(x, y, il, tl * 0, (0, 1, 2), reduction='mean_volume'),
                               tdt_loss(x, y, il, tl * 0, (0, 1, 2), reduction='sum'))        # (no labels: divided by 1)

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
def test_edge_cases(backend):
    if backend not in BACKENDS: pytest.skip(f"{backend} not built yet")
    torch.manual_seed(21)
    D, V = 3, 5
    x = torch.randn(3, 4, 3, V + D, dtype=torch.float64)
    lp, dlp = x[..., :V].log_softmax(-1), x[..., V:].log_softmax(-1)
    f = lambda x, y, il, tl, **kw: tdt_loss(x, y, il, tl, (0, 1, 2), 4, reduction='none', backend=backend, **kw)
    # T = 1, U = 2: both labels in frame 0 (duration 0), then a blank of duration 1
    torch.testing.assert_close(f(x[:1, :1], torch.tensor([[1, 2]]), torch.tensor([1]), torch.tensor([2])),
                               -(lp[0, 0, 0, 1] + dlp[0, 0, 0, 0] + lp[0, 0, 1, 2] + dlp[0, 0, 1, 0] + lp[0, 0, 2, 4] + dlp[0, 0, 2, 1])[None])
    # infeasible: without duration 0, two labels cannot fit in two frames (each label takes a frame, the last blank one)
    loss = tdt_loss(x.requires_grad_(), torch.tensor([[1, 2]] * 3), torch.tensor([2, 4, 3]), torch.tensor([2, 2, 2]), (1, 2),
                    4, reduction='none', backend=backend)
    assert loss[0].item() == math.inf and torch.isfinite(loss[1:]).all()
    g, = torch.autograd.grad(loss[1:].sum() + 0 * loss[0], x)
    assert not torch.isnan(g).any() and (g[0] == 0).all()
    x = x.detach()
    # a NaN logit inside the lattice: a NaN cost and NaN gradients for that sequence only
    xn = x.clone(); xn[1, 0, 0, 3] = math.nan
    xn.requires_grad_()
    loss = f(xn, torch.tensor([[1, 2]] * 3), torch.tensor([4, 4, 4]), torch.tensor([2, 2, 2]))
    g, = torch.autograd.grad(loss.sum(), xn)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()
    assert torch.isnan(g[1]).any() and torch.isfinite(g[[0, 2]]).all()

def test_non_contiguous_inputs_left_unmodified():
    torch.manual_seed(22)
    base = torch.randn(5, 2, 4, 6 + 3, dtype=torch.float64)         # (T, B, U+1, V + D): a batch-second layout
    x = base.transpose(0, 1)
    y = torch.tensor([[1, 2, 3, 9], [3, 3, 1, 9]])[:, :3]
    il, tl = torch.tensor([5, 3]), torch.tensor([3, 2])
    saved = [t.clone() for t in (base, y, il, tl)]
    results = [tdt_lg(x, y, il, tl, (0, 1, 2), 0, reduction='none', backend=b) for b in BACKENDS]
    for r in results[1:]:
        torch.testing.assert_close(r[0], results[0][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r[1], results[0][1], rtol=1e-10, atol=1e-12)
    for a, b in zip((base, y, il, tl), saved): assert torch.equal(a, b)

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_low_precision_inputs_are_computed_in_float32(dtype):
    torch.manual_seed(23)
    x = torch.randn(2, 6, 4, 8 + 5).to(dtype)
    y, il, tl = torch.randint(1, 8, (2, 3)), torch.tensor([6, 5]), torch.tensor([3, 2])
    l, g = tdt_lg(x, y, il, tl, (0, 1, 2, 3, 4), 0, reduction='none')
    l32, g32 = tdt_lg(x.float(), y, il, tl, (0, 1, 2, 3, 4), 0, reduction='none')
    assert l.dtype == g.dtype == dtype
    torch.testing.assert_close(l, l32.to(dtype)); torch.testing.assert_close(g, g32.to(dtype))

def test_modules_equal_functions():
    torch.manual_seed(24)
    x = torch.randn(2, 5, 3, 6 + 3, requires_grad=True)
    y, il, tl = torch.randint(0, 5, (2, 2), dtype=torch.int32), torch.tensor([5, 4], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    m = TDTLoss((0, 1, 2), sigma=0.05, omega=0.1, clamp=0.1, reduction='sum', fastemit_lambda=0.01, delay_penalty=0.1)
    assert torch.equal(m(x, y, il, tl), tdt_loss(x, y, il, tl, (0, 1, 2), -1, 0.05, 0.1, 0.1, 0.01, 0.1, 'sum'))
    m = MultiblankRNNTLoss((2, 3), sigma=0.05, reduction='mean_volume')
    assert torch.equal(m(x, y, il, tl), multiblank_rnnt_loss(x, y, il, tl, (2, 3), sigma=0.05, reduction='mean_volume'))

def test_torch_compile_fullgraph():
    torch.manual_seed(25)
    x = torch.randn(3, 6, 4, 7 + 5).requires_grad_()
    y, il, tl = torch.randint(1, 7, (3, 3), dtype=torch.int32), torch.tensor([6, 4, 1], dtype=torch.int32), torch.tensor([3, 1, 0], dtype=torch.int32)
    def f(x): return tdt_loss(x * 2.0, y, il, tl, blank=0, sigma=0.05, omega=0.1, clamp=0.5, fastemit_lambda=0.01) * 3.0
    import torch._inductor.config as inductor_config
    with inductor_config.patch(fx_graph_cache=False):
        eager, comp = f(x), torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(comp, x)[0], torch.autograd.grad(eager, x)[0], rtol=1e-5, atol=1e-7)

x0 = torch.randn(2, 4, 3, 5 + 5)
y0, il0, tl0 = torch.tensor([[1, 2], [3, 1]], dtype=torch.int32), torch.tensor([4, 3], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
BAD = [
    (dict(durations=[0, 2, 3]), ValueError, r"durations must include 1 \(a blank that moves one frame; NeMo's kernels require it\), got \[0, 2, 3\]"),
    (dict(durations=[1, 0, 2]), ValueError, r"durations must be strictly increasing \(sorted, no repeats\), got \[1, 0, 2\]"),
    (dict(durations=[0, 1, 1]), ValueError, r"durations must be strictly increasing"),
    (dict(durations=[-1, 0, 1]), ValueError, r"durations must be >= 0, got \[-1, 0, 1\]"),
    (dict(durations=[]), ValueError, r"durations must not be empty"),
    (dict(durations=[0, 1.5]), TypeError, r"durations must be a list of ints, got \[0, 1.5\]"),
    (dict(durations=3), TypeError, r"durations must be a list of ints, got 3"),
    (dict(durations=list(range(40))), ValueError, r"durations may hold at most 32 values, got 40"),
    (dict(durations=[0, 1, 2]), None, None),                                          # fine: V = 7
    (dict(logits=x0[..., :5]), ValueError, r"logits' last dimension must be V \+ len\(durations\) with V >= 1 tokens: got 5 for 5 durations"),
    (dict(logits=x0[0]), ValueError, r"logits must have shape \(B, T, U\+1, V \+ len\(durations\)\), got \(4, 3, 10\)"),
    (dict(logits=[1.0]), TypeError, r"logits must be a tensor, got list"),
    (dict(logits=x0.long()), TypeError, r"logits must be float16, bfloat16, float32 or float64, got torch.int64"),
    (dict(targets=torch.tensor([[1, 7], [3, 4]])), ValueError, r"targets must hold labels in \[0, V\) = \[0, 5\), got \[7\]"),
    (dict(targets=torch.tensor([[1, 4], [3, 4]])), ValueError, r"targets contain the blank label 4 within their target_lengths"),
    (dict(targets=torch.tensor([[1, 0], [3, 4]]), blank=0), ValueError, r"targets contain the blank label 0 within"),
    (dict(logit_lengths=torch.tensor([4, 5])), ValueError, r"logit_lengths must be in \[1, T\] = \[1, 4\], got \[5\]"),
    (dict(logit_lengths=torch.tensor([0, 4])), ValueError, r"logit_lengths must be in \[1, T\] = \[1, 4\], got \[0\]"),
    (dict(target_lengths=torch.tensor([3, 1])), ValueError, r"target_lengths must be in \[0, min\(U, targets.shape\[1\]\)\] = \[0, 2\]"),
    (dict(target_lengths=torch.tensor([-1, 1])), ValueError, r"target_lengths must be in \[0, min.*got \[-1\]"),
    (dict(logit_lengths=torch.tensor([4.0, 3.0])), TypeError, r"logit_lengths must hold integers"),
    (dict(blank=5), ValueError, r"blank must be an int in \[-V, V\) = \[-5, 5\)"),
    (dict(reduction='mean_batch'), ValueError, r"reduction must be 'none', 'sum', 'mean' or 'mean_volume', got 'mean_batch'"),
    (dict(sigma='0.05'), TypeError, r"sigma must be a real number, got '0.05'"),
    (dict(omega=1.5), ValueError, r"omega must be in \[0, 1\] \(the RNN-T loss's weight\), got 1.5"),
    (dict(fastemit_lambda=-0.1), ValueError, r"fastemit_lambda must be >= 0, got -0.1"),
    (dict(delay_penalty=math.inf), ValueError, r"delay_penalty must be finite, got inf"),
    (dict(backend='gpu'), ValueError, r"backend must be 'auto', 'cpu'.*'reference', got 'gpu'"),
]

@pytest.mark.parametrize('bad,error,message', BAD)
def test_tdt_bad_input_is_a_clear_error(bad, error, message):
    args = dict(logits=x0, targets=y0, logit_lengths=il0, target_lengths=tl0)
    args.update(bad)
    if error is None: assert torch.isfinite(tdt_loss(**args)); return
    with pytest.raises(error, match=message): tdt_loss(**args)

BAD_MULTIBLANK = [
    (dict(big_blank_durations=[1, 2]), ValueError, r"big_blank_durations must be >= 2, got \[1, 2\]"),
    (dict(big_blank_durations=[2, 'a']), TypeError, r"big_blank_durations must be a list of ints"),
    (dict(blank=1), ValueError, r"blank must be >= len\(big_blank_durations\) = 2, got 1"),
    (dict(targets=torch.tensor([[1, 8], [3, 4]])), ValueError, r"targets contain big blanks \[8\] \(tokens 7..8\) within their target_lengths"),
    (dict(targets=torch.tensor([[1, 9], [3, 4]])), ValueError, r"targets contain the blank label 9"),
    (dict(targets=torch.tensor([[6, 7], [3, 4]])), ValueError, r"targets contain big blanks \[7\]"),    # (6 is a label)
]

@pytest.mark.parametrize('bad,error,message', BAD_MULTIBLANK)
def test_multiblank_bad_input_is_a_clear_error(bad, error, message):
    args = dict(logits=x0, targets=y0, logit_lengths=il0, target_lengths=tl0, big_blank_durations=[2, 4])
    args.update(bad)
    with pytest.raises(error, match=message): multiblank_rnnt_loss(**args)

# ---------------------------------------------------------------------------------------------------------------------
# Alignments
from seqdist.tdt import tdt_alignments, multiblank_alignments, tdt_best_path
from seqdist.ops import launch_limits

def tdt_paths(T, U, durations):
    "Every path of a TDT lattice: lists of (t, u, label?, duration) edges."
    out = []
    def walk(t, u, path):
        if t == T: out.append(path); return
        for d in durations:
            if d > 0 and (t + d < T or (t + d == T and u == U)): walk(t + d, u, path + [(t, u, 0, d)])
            if u < U and t + d < T: walk(t + d, u + 1, path + [(t, u, 1, d)])
    walk(0, 0, [])
    return out

def test_best_path_is_the_best_of_brute_force():
    rng = random.Random(30)
    for _ in range(12):
        x, y, il, tl, durations, blank = random_tdt(rng, rng.choice([(0, 1, 2), (0, 1, 2, 3)]), max_T=5, max_U=3)
        lp, dlp, yc, ilc, tlc, b = tdt_parts(x, y, il, tl, durations, blank)
        for backend in BACKENDS:
            frames, dur, score = tdt_best_path(x, y, il, tl, durations, blank, backend=backend)
            for i in range(x.shape[0]):
                Tb, Ub = int(il[i]), int(tl[i])
                paths = tdt_paths(Tb, Ub, durations)
                if not paths: assert score[i] == -math.inf; continue
                val = lambda p: sum(float((lp[i, t, u, yc[i, u]] if lab else lp[i, t, u, b]) + dlp[i, t, u, durations.index(d)])
                                    for t, u, lab, d in p)
                best = max(paths, key=val)
                assert abs(score[i].item() - val(best)) < 1e-9
                emits = [(t, d) for t, u, lab, d in best if lab]
                assert frames[i, :Ub].tolist() == [t for t, _ in emits] and dur[i, :Ub].tolist() == [d for _, d in emits]
                assert (frames[i, Ub:] == -1).all() and (dur[i, Ub:] == -1).all()

@pytest.mark.parametrize('S', [Log, Max])
@pytest.mark.parametrize('max_threads', [1024, 32])        # 32: U + 1 = 37 nodes and rows of 40 + 5, the looping paths
def test_alignments_agree_on_every_path(S, max_threads):
    torch.manual_seed(31)
    B, T, U, V = 3, 5, 36, 40
    x = torch.randn(B, T, U + 1, V + 3, dtype=torch.float64) * 2
    y = torch.randint(1, V, (B, U))
    il, tl = torch.tensor([5, 3, 1]), torch.tensor([36, 20, 0])
    with launch_limits(max_threads=max_threads):
        ref = tdt_alignments(x, y, il, tl, (0, 1, 2), 0, sigma=0.05, delay_penalty=0.1, S=S, backend='reference')
        refm = multiblank_alignments(x, y, il, tl, (2, 3), 42, S=S, backend='reference')
        for backend in ('cpu', 'cuda'):
            with emulator_options(seed=1):
                assert_same(tdt_alignments(x, y, il, tl, (0, 1, 2), 0, sigma=0.05, delay_penalty=0.1, S=S, backend=backend), ref, **TOL64)
                assert_same(multiblank_alignments(x, y, il, tl, (2, 3), 42, S=S, backend=backend), refm, **TOL64)
        if max_threads == 32:
            with emulator_options(seed=2):
                three_paths(tdt_loss, x[:2, :, :, :43], y[:2], il[:2], tl[:2], (0, 1, 2), 0, reduction='none', omega=0.2)
    if S is Log:            # every label is emitted once
        assert_same(ref[..., 1, :].sum((1, 2, 3)), tl.double(), rtol=1e-9, atol=1e-9)
        assert_same(refm[..., -1].sum((1, 2)), tl.double(), rtol=1e-9, atol=1e-9)

def test_targets_are_checked_and_cleaned_once_per_forward_and_backward(monkeypatch):
    "tdt's prepare cleans (and checks) the targets with rnnt's `clean_targets`, once per fwd+bwd on every path."
    calls, clean = [], tdt.clean_targets
    monkeypatch.setattr(tdt, 'clean_targets', lambda *args: calls.append(args[-1]) or clean(*args))
    x = torch.randn(2, 4, 3, 5 + 3, requires_grad=True)
    y, il, tl = torch.tensor([[1, 2], [3, 1]]), torch.tensor([4, 3]), torch.tensor([2, 1])
    for backend in ('cpu', 'cuda', 'reference'):
        for kw in (dict(durations=(0, 1, 2)), dict(durations=(0, 1, 2), omega=0.5)):
            calls.clear()
            torch.autograd.grad(tdt.tdt_loss(x, y, il, tl, blank=0, backend=backend, **kw), x)
            assert calls == [True], (backend, kw, calls)

# ---------------------------------------------------------------------------------------------------------------------
# The PyTorch TDT loss (the benchmarks' anchor): a third implementation, vectorised over anti-diagonals
from seqdist.benchmarks.tdt import tdt_loss_pytorch
from seqdist.benchmarks.tdt import load_hf_tdt_loss, bench_tdt

@pytest.mark.parametrize('durations', [(0, 1, 2, 3, 4), (0, 1, 2), (1, 2), (0, 1, 2, 3, 4, 5, 6, 7, 8)])
def test_pytorch_tdt_loss_equals_tdt_loss(durations):
    "float64, variable lengths (U = 0 and T = 1 occur), garbage target padding, any blank, sigma, every reduction."
    rng = random.Random(40 + len(durations))
    for _ in range(8):
        x, y, il, tl, durations, blank = random_tdt(rng, durations, max_B=4, max_T=12, max_U=5)
        kw = dict(sigma=rng.choice([0.0, 0.05, 0.3]), reduction=rng.choice(['none', 'sum', 'mean', 'mean_volume']))
        ours = loss_and_grad(tdt_loss, x, y, il, tl, durations, blank, backend='cpu', **kw)
        theirs = loss_and_grad(tdt_loss_pytorch, x, y, il, tl, durations, blank, **kw)
        assert_same(theirs[0], ours[0], **TOL64); assert_same(theirs[1], ours[1], **TOL64)

def test_pytorch_tdt_loss_infeasible_is_inf_with_zero_gradient():
    "Durations (1, 2) take a frame per label: 3 labels in 2 frames have no path (inf, no gradient), as in tdt_loss."
    x = torch.randn(2, 2, 4, 6 + 2, dtype=torch.float64)
    y, il, tl = torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([2, 2]), torch.tensor([3, 1])
    theirs = loss_and_grad(tdt_loss_pytorch, x, y, il, tl, (1, 2), reduction='none')
    ours = loss_and_grad(tdt_loss, x, y, il, tl, (1, 2), reduction='none')
    assert theirs[0][0] == math.inf and math.isfinite(theirs[0][1]) and (theirs[1][0] == 0).all()
    assert_same(theirs[0], ours[0], **TOL64); assert_same(theirs[1], ours[1], **TOL64)

def test_pytorch_tdt_loss_float32_close_to_float64():
    x, y, il, tl = tdt_benchmarks.tdt_inputs_for(2, 30, 8, 20, dtype=torch.float64)
    il, tl = torch.tensor([30, 17]), torch.tensor([8, 3])
    l64, g64 = loss_and_grad(tdt_loss_pytorch, x, y, il, tl, reduction='none')
    l32, g32 = loss_and_grad(tdt_loss_pytorch, x.float(), y, il, tl, reduction='none')
    assert l32.dtype == g32.dtype == torch.float32
    assert_same(l32, l64, **TOL32_REF); assert_same(g32, g64, **TOL32_REF)

def test_transformers_tdt_loss_equals_tdt_loss():
    "transformers' Parakeet TDT loss (the other anchor of bench_tdt), where it is installed (not by `make install`)."
    hf = load_hf_tdt_loss()
    if hf is None: pytest.skip("transformers is not installed")
    rng = random.Random(50)
    for durations in [(0, 1, 2, 3, 4), (0, 1, 2)]:
        for _ in range(4):
            x, y, il, tl, durations, blank = random_tdt(rng, durations, max_B=4, max_T=12, max_U=5)
            V, sigma = x.shape[-1] - len(durations), rng.choice([0.0, 0.05])
            yc = torch.where(torch.arange(y.shape[1])[None] < tl[:, None], y, 0)
            theirs = hf(x[..., :V], x[..., V:], yc, il, tl, blank % V, list(durations), sigma=sigma, reduction='none')
            ours = tdt_loss(x, y, il, tl, durations, blank, sigma=sigma, reduction='none')
            torch.testing.assert_close(theirs.double(), ours, rtol=1e-5, atol=1e-5)    # (it computes in float32)

def test_bench_tdt_quick_rows():
    "The rows seqdist-bench prints: the anchors agree with tdt_loss; times and peak memory (fresh processes) measured."
    import re
    rows = bench_tdt(quick=True, memory=True)
    assert rows[0]['anchor'] == 'PyTorch TDT loss (tdt_loss_pytorch)' and rows[-1]['anchor'].startswith('seqdist rnnt_loss')
    assert all(r['ours_ms'] > 0 and r['anchor_ms'] > 0 and r['ours_mb'] >= 0 and r['anchor_mb'] >= 0 for r in rows)
    for r in rows[:-1]:
        loss_diff, grad_diff = map(float, re.fullmatch(r"loss diff (\S+), grad diff (\S+)", r['check']).groups())
        assert loss_diff < 1e-4 and grad_diff < 1e-5, r
    assert "x the logits'" in rows[-1]['check']
