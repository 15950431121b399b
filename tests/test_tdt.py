"""TDT and multi-blank transducers: the reference equals brute-force enumeration (Log and Max) and a re-derivation of
NeMo's recursion; the multi-blank lattice without big blanks is the RNN-T's; the op's three paths (reference, numba,
CUDA source in the emulator) agree, pass gradcheck, and implement sigma, omega, FastEmit, clamp and the delay penalty
as stated; bad inputs, torch.compile, low precision, alignments."""
import math, random, pytest, torch
import seqdist.tdt as tdt
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
    x = torch.randn(2, 4, 3, 4 + 3, dtype=torch.float64, requires_grad=True)
    y, il, tl = torch.tensor([[1, 2], [0, 3]]), torch.tensor([4, 3]), torch.tensor([2, 1])
    table = edge_table(durations, (), 3, True)
    def f(x):
        lp, dlp = x[..., :4].log_softmax(-1), x[..., 4:].log_softmax(-1)
        s = edge_scores(lp, dlp, torch.nn.functional.pad(y, (0, 1), value=3), table, (0.1, 0.0), tdt.delay_offsets(il, 4, 0.3))
        return torch.stack([logz_reference(s, table, il, tl, Log, lat) for lat in (0, 1)])
    assert torch.autograd.gradcheck(f, (x,))
