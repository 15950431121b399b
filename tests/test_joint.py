"""The fused joint + RNN-T loss: the reference is the composition a user writes (the joiner, then rnnt_loss); the
tiled paths equal it in float64 (loss and the four gradients, <= 1e-9 relative) on randomised cases with every
option, and stay within the composition's own float32 error; the delay penalty equals path enumeration; no
(B, T, U+1, V) or (B, T, U+1, H) tensor is ever made; gradcheck, torch.compile, the module, bad inputs."""
import math, random, pytest, torch
from torch.utils._python_dispatch import TorchDispatchMode
import seqdist.joint as joint
import seqdist.ops as ops
from seqdist.joint import joint_rnnt_loss, joint_logits, delay_offsets, JointRNNTLoss, joint_rnnt_op
from seqdist.rnnt import rnnt_loss, logz_brute_force, posteriors, grad_from_edges
from seqdist.ops import launch_limits

PARAMS = ('encoder_out', 'predictor_out', 'weight', 'bias')

def random_case(rng, dtype=torch.float64, max_B=4, max_T=9, max_U=5, max_V=9, max_H=6, bias=None):
    "Joiner inputs with variable lengths and garbage in the targets' padding; blank anywhere."
    B, T, U, V, H = rng.randint(1, max_B), rng.randint(1, max_T), rng.randint(0, max_U), rng.randint(2, max_V), rng.randint(1, max_H)
    blank = rng.choice([0, V - 1, -1, rng.randrange(V)])
    labels = [c for c in range(V) if c != blank % V]
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    scale = rng.choice([0.5, 1.0, 3.0])
    e = (torch.randn(B, T, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    p = (torch.randn(B, U + 1, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    W = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    with_bias = rng.random() < 0.5 if bias is None else bias
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype) if with_bias else None
    tl = torch.tensor([rng.randint(0, U) for _ in range(B)])
    il = torch.tensor([rng.randint(1, T) for _ in range(B)])
    y = torch.tensor([[rng.choice(labels) if u < tl[i] else rng.randint(-3, V + 3) for u in range(U)] for i in range(B)],
                     dtype=torch.int32).view(B, U)
    return dict(encoder_out=e, predictor_out=p, weight=W, bias=b, targets=y, logit_lengths=il, target_lengths=tl, blank=blank)

def loss_and_grads(case, **kw):
    "The loss and the gradients of its weighted sum (a weight per sequence for reduction='none') w.r.t. the four inputs."
    args = {k: (v.detach().requires_grad_() if k in PARAMS and v is not None else v) for k, v in case.items()}
    loss = joint_rnnt_loss(**args, **kw)
    w = torch.arange(1, loss.numel() + 1, dtype=loss.dtype).view(loss.shape)
    xs = [args[k] for k in PARAMS if args[k] is not None]
    return [loss.detach(), *torch.autograd.grad((loss * w).sum(), xs)]

def assert_relative(got, want, rtol, what=''):
    "Each tensor within rtol of the reference, relative to the reference's largest magnitude."
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        scale = b.abs().max().item() if b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=0, atol=rtol * max(scale, 1e-30), msg=lambda m: f"{what} output {i}: {m}")

def options(rng):
    "A random set of options: activation, clamp, FastEmit, delay penalty, reduction."
    return dict(activation=rng.choice(['relu', 'tanh', 'identity']), clamp=rng.choice([-1, -1, 0.05, 0.5]),
                fastemit_lambda=rng.choice([0.0, 0.0, 0.01, 0.5]), delay_penalty=rng.choice([0.0, 0.0, 0.1]),
                reduction=rng.choice(['none', 'sum', 'mean']))

def test_joint_logits_is_the_joiner():
    "torchaudio's joiner (and any act + nn.Linear(H, V)) computes the same logits."
    from seqdist.timing import load_torchaudio
    torch.manual_seed(0)
    e, p = torch.randn(2, 5, 4), torch.randn(2, 3, 4)
    lin = torch.nn.Linear(4, 7)
    for act, f in (('relu', torch.relu), ('tanh', torch.tanh), ('identity', lambda x: x)):
        torch.testing.assert_close(joint_logits(e, p, lin.weight, lin.bias, act), lin(f(e[:, :, None] + p[:, None])))
    ta = load_torchaudio()
    if ta is None: pytest.skip("torchaudio not importable")
    from torchaudio.models.rnnt import _Joiner
    j = _Joiner(4, 7, activation='tanh')
    out, _, _ = j(e, torch.tensor([5, 5]), p, torch.tensor([3, 3]))
    torch.testing.assert_close(joint_logits(e, p, j.linear.weight, j.linear.bias, 'tanh'), out)

def test_delay_offsets_are_k2s():
    il = torch.tensor([5, 2])
    want = torch.tensor([[0.2 * ((T - 1) / 2 - t) for t in range(5)] for T in (5, 2)], dtype=torch.float64)
    torch.testing.assert_close(delay_offsets(il, 5, 0.2), want)

@pytest.mark.parametrize('backend', ['reference', 'cpu'])
def test_delay_penalty_equals_path_enumeration(backend):
    "With the penalty, each path's score gains delay_penalty * ((T_b - 1)/2 - t) per label emitted in frame t."
    rng = random.Random(3)
    for _ in range(10):
        case = random_case(rng, max_T=5, max_U=3, max_V=5)
        dp = rng.choice([0.3, -0.2])
        costs = joint_rnnt_loss(**case, delay_penalty=dp, reduction='none', backend=backend)
        z = joint_logits(case['encoder_out'], case['predictor_out'], case['weight'], case['bias'])
        V, blank = z.shape[-1], case['blank'] % z.shape[-1]
        perm = [c for c in range(V) if c != blank] + [blank]                 # brute force takes blank last
        for b in range(z.shape[0]):
            Tb, Ub = int(case['logit_lengths'][b]), int(case['target_lengths'][b])
            lp = z[b, :Tb, :Ub + 1].log_softmax(-1)[..., perm].clone()
            lp[..., :-1] += delay_offsets(case['logit_lengths'][b:b + 1], Tb, dp)[0][:, None, None]
            labels = [perm.index(int(c)) for c in case['targets'][b, :Ub]]
            torch.testing.assert_close(costs[b], -logz_brute_force(lp, labels), rtol=1e-12, atol=1e-12)

def test_fp64_agrees_with_the_composition_on_randomised_cases():
    """Loss and the four gradients of the tiled CPU path equal the composition's within 1e-9 (relative): variable
    lengths, every activation, bias or not, clamp, FastEmit, delay penalty, every reduction, tiles of a few rows (the
    frames split along u) up to whole utterances."""
    rng = random.Random(0)
    n = 0
    for i in range(120):
        case, kw = random_case(rng), options(rng)
        if kw['clamp'] > 0 and kw['delay_penalty']: kw['delay_penalty'] = 0.0      # (the reference takes one of them)
        want = loss_and_grads(case, **kw, backend='reference')
        for tile_bytes in (None, rng.choice([8, 64, 300, 2000])):
            got = loss_and_grads(case, **kw, backend='cpu', tile_bytes=tile_bytes)
            assert_relative(got, want, 1e-9, f"case {i} {kw} tile_bytes={tile_bytes}")
            n += 1
    assert n == 240

def test_clamp_with_delay_penalty_equals_the_closed_form():
    """The pair the reference does not take: the fused path's gradient is the closed form of the notes (posteriors of
    the penalised lattice, softmax terms, clamp, then g_b) sent back through the joiner by autograd."""
    rng = random.Random(5)
    for _ in range(15):
        case = random_case(rng)
        kw = dict(clamp=rng.choice([0.02, 0.2]), delay_penalty=rng.choice([0.1, -0.3]), fastemit_lambda=rng.choice([0.0, 0.2]),
                  activation=rng.choice(['relu', 'tanh', 'identity']))
        got = loss_and_grads(case, **kw, reduction='none', backend='cpu', tile_bytes=rng.choice([None, 100]))
        xs = {k: (v.detach().requires_grad_() if k in PARAMS and v is not None else v) for k, v in case.items()}
        z = joint_logits(xs['encoder_out'], xs['predictor_out'], xs['weight'], xs['bias'], kw['activation'])
        V = z.shape[-1]
        blank = xs['blank'] % V
        yc, il, tl = joint.clean_targets(z, xs['targets'], xs['logit_lengths'], xs['target_lengths'], blank)
        lp = z.detach().log_softmax(-1)
        edge = torch.stack([lp[..., blank], lp.gather(3, yc[:, None, :, None].expand(*lp.shape[:3], 1))[..., 0]], -1)
        edge[..., 1] += delay_offsets(il, z.shape[1], kw['delay_penalty'])[:, :, None]
        ones = torch.ones(z.shape[0], z.shape[2] - 1, dtype=torch.long)
        costs = rnnt_loss(edge, ones, il, tl, 0, reduction='none', fused_log_softmax=False)
        post = posteriors(edge, ones, il, tl, 0, fused_log_softmax=False)
        g = torch.arange(1, z.shape[0] + 1, dtype=z.dtype)
        dz = grad_from_edges(z.detach(), yc, blank, True, post, costs, g, kw['clamp'], kw['fastemit_lambda'])
        ins = [xs[k] for k in PARAMS if xs[k] is not None]
        assert_relative(got, [costs, *torch.autograd.grad(z, ins, dz)], 1e-9, str(kw))

def test_reference_takes_clamp_with_delay_penalty():
    "The composition runs rnnt_loss with its own delay penalty: clamp, FastEmit and the penalty compose as fused."
    rng = random.Random(1)
    for _ in range(4):
        case = random_case(rng)
        kw = dict(clamp=rng.choice([0.02, 0.2]), delay_penalty=rng.choice([0.1, -0.3]), fastemit_lambda=0.2, reduction='none')
        assert_relative(loss_and_grads(case, **kw, backend='reference'), loss_and_grads(case, **kw, backend='cpu'), 1e-9, str(kw))

@pytest.mark.parametrize('backend', ['reference', 'cpu'])
def test_gradcheck(backend):
    torch.manual_seed(0)
    e, p = torch.randn(2, 4, 3, dtype=torch.float64), torch.randn(2, 3, 3, dtype=torch.float64)
    W, b = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    y, il, tl = torch.tensor([[1, 2], [3, 0]]), torch.tensor([4, 3]), torch.tensor([2, 1])
    for act in ('tanh', 'identity'):          # (relu's kink would need care in the finite differences)
        f = lambda e, p, W, b: joint_rnnt_loss(e, p, W, y, il, tl, b, act, blank=0, reduction='none', fastemit_lambda=0.0,
                                               backend=backend, tile_bytes=64)
        assert torch.autograd.gradcheck(f, tuple(x.clone().requires_grad_() for x in (e, p, W, b)))

@pytest.mark.parametrize('dtype', [torch.float32])
def test_float32_within_the_compositions_own_error(dtype):
    "Against the float64 composition, our float32 error is within 3x the float32 composition's (or 1e-6 relative)."
    rng = random.Random(2)
    for i in range(20):
        case = random_case(rng, max_T=20, max_U=8, max_V=40, max_H=16)
        kw = options(rng)
        kw['delay_penalty'] = 0.0
        exact = loss_and_grads(case, **kw, backend='reference')
        low = {k: (v.to(dtype) if k in PARAMS and v is not None else v) for k, v in case.items()}
        comp = loss_and_grads(low, **kw, backend='reference')
        ours = loss_and_grads(low, **kw, backend='cpu', tile_bytes=rng.choice([None, 500]))
        for j, (o, c, x) in enumerate(zip(ours, comp, exact)):
            scale = x.abs().max().item() or 1.0
            err_o, err_c = (o.double() - x).abs().max().item() / scale, (c.double() - x).abs().max().item() / scale
            assert err_o <= max(3 * err_c, 1e-6), f"case {i} {kw} output {j}: ours {err_o:.1e}, composition {err_c:.1e}"

class Storages(TorchDispatchMode):
    "The op, shape and storage bytes of every tensor that an op in the block returns (a view: its base's storage)."
    def __init__(self):
        super().__init__()
        self.seen = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor): self.seen.append((str(func), tuple(o.shape), o.untyped_storage().nbytes()))
        return out

def test_no_logits_or_activations_sized_tensor_is_ever_made():
    "Forward and backward: no tensor as large as the (B, T, U+1, V) logits or the (B, T, U+1, H) activations."
    torch.manual_seed(0)
    B, T, U, V, H = 3, 40, 12, 64, 32
    case = dict(encoder_out=torch.randn(B, T, H), predictor_out=torch.randn(B, U + 1, H), weight=torch.randn(V, H),
                bias=torch.randn(V), targets=torch.randint(1, V, (B, U)), logit_lengths=torch.full((B,), T),
                target_lengths=torch.full((B,), U), blank=0)
    with Storages() as ops: loss_and_grads(case, tile_bytes=16 << 10)
    nodes = B * T * (U + 1)
    logits, activations = nodes * V * 4, nodes * H * 4
    biggest = max(ops.seen, key=lambda s: s[2])
    assert biggest[2] <= max(16 << 10, 16 * nodes), biggest       # a tile of logits, or two float64 per node
    assert biggest[2] < min(logits, activations) / 5

def test_module_is_a_joiner_and_its_loss():
    "JointRNNTLoss loads a joiner's state_dict (torchaudio's keys) and equals the composition with that joiner."
    torch.manual_seed(1)
    H, V = 6, 11
    joiner = torch.nn.Module()
    joiner.linear = torch.nn.Linear(H, V)
    m = JointRNNTLoss(H, V, activation='tanh', blank=0, fastemit_lambda=0.1)
    m.load_state_dict(joiner.state_dict())
    assert set(m.state_dict()) == {'linear.weight', 'linear.bias'}
    e, p = torch.randn(2, 7, H, requires_grad=True), torch.randn(2, 4, H, requires_grad=True)
    y, il, tl = torch.randint(1, V, (2, 3)), torch.tensor([7, 5]), torch.tensor([3, 2])
    want = rnnt_loss(joiner.linear(torch.tanh(e[:, :, None] + p[:, None])), y, il, tl, blank=0, fastemit_lambda=0.1)
    got = m(e, p, y, il, tl)
    torch.testing.assert_close(got, want)
    gw = torch.autograd.grad(want, (e, p, *joiner.linear.parameters()))
    gg = torch.autograd.grad(got, (e, p, *m.linear.parameters()))
    for a, b in zip(gg, gw): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.joint(e, p), joiner.linear(torch.tanh(e[:, :, None] + p[:, None])))
    assert 'activation=' in repr(m) and JointRNNTLoss(H, V, bias=False).linear.bias is None

def test_only_the_wanted_gradients():
    "Each subset of inputs that require grad gets the composition's gradients."
    case = random_case(random.Random(4), bias=True)
    want = loss_and_grads(case, backend='reference')
    for keep in (('weight',), ('encoder_out',), ('predictor_out', 'bias')):
        args = {k: (v.detach().requires_grad_(k in keep) if k in PARAMS else v) for k, v in case.items()}
        loss = joint_rnnt_loss(**args, backend='cpu')
        got = torch.autograd.grad(loss, [args[k] for k in keep])
        assert_relative(list(got), [want[1 + PARAMS.index(k)] for k in keep], 1e-9, str(keep))

def test_edge_cases():
    "U = 0 (no labels), T = 1, one utterance, V = 2, bias-free, non-contiguous inputs, inputs left unmodified."
    torch.manual_seed(2)
    cases = [dict(encoder_out=torch.randn(2, 5, 3, dtype=torch.float64), predictor_out=torch.randn(2, 1, 3, dtype=torch.float64),
                  weight=torch.randn(4, 3, dtype=torch.float64), bias=None, targets=torch.zeros(2, 0, dtype=torch.long),
                  logit_lengths=torch.tensor([5, 2]), target_lengths=torch.tensor([0, 0]), blank=0),
             dict(encoder_out=torch.randn(1, 1, 3, dtype=torch.float64), predictor_out=torch.randn(1, 3, 3, dtype=torch.float64),
                  weight=torch.randn(2, 3, dtype=torch.float64), bias=torch.randn(2, dtype=torch.float64),
                  targets=torch.tensor([[1, 1]]), logit_lengths=torch.tensor([1]), target_lengths=torch.tensor([2]), blank=0),
             dict(encoder_out=torch.randn(3, 3, 6, dtype=torch.float64)[..., ::2],                 # (3, 3, 3), strided
                  predictor_out=torch.randn(3, 3, 4, dtype=torch.float64).transpose(1, 2),           # (3, 4, 3), strided
                  weight=torch.randn(3, 5, dtype=torch.float64).T, bias=torch.randn(10, dtype=torch.float64)[::2],
                  targets=torch.tensor([[1, 2, 3], [4, 1, 2], [2, 2, 2]]).T, logit_lengths=torch.tensor([3, 1, 2]),
                  target_lengths=torch.tensor([3, 0, 2]), blank=0)]
    for case in cases:
        before = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
        want = loss_and_grads(case, backend='reference')
        for tile_bytes in (None, 8):
            assert_relative(loss_and_grads(case, backend='cpu', tile_bytes=tile_bytes), want, 1e-9)
        for k, v in before.items(): assert torch.equal(case[k], v), k

def test_bitwise_repeatable():
    case = random_case(random.Random(6), max_T=30, max_U=10, max_V=50, max_H=16)
    a, b = loss_and_grads(case, backend='cpu', tile_bytes=1000), loss_and_grads(case, backend='cpu', tile_bytes=1000)
    for u, v in zip(a, b): assert torch.equal(u, v)

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_computed_in_float32(dtype):
    "fp16/bf16 inputs: the float32 computation on the rounded inputs; gradients in the inputs' dtype."
    case = random_case(random.Random(7), dtype=dtype, bias=True)
    got = loss_and_grads(case, backend='cpu')
    assert all(g.dtype == dtype for g in got)
    full = {k: (v.float() if k in PARAMS else v) for k, v in case.items()}
    want = loss_and_grads(full, backend='cpu')
    tol = 2 ** -9 if dtype == torch.float16 else 2 ** -6                          # a few roundings to the input dtype
    for a, b in zip(got, want): torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol * b.abs().max().item())

def test_torch_compile_fullgraph():
    "Traced through the op layer (custom op + its backward op): the eager result."
    case = random_case(random.Random(8), dtype=torch.float32, bias=True)
    xs = {k: (v.detach().requires_grad_() if k in PARAMS else v) for k, v in case.items()}
    def f(e, p, W, b): return joint_rnnt_loss(e * 2.0, p, W, xs['targets'], xs['logit_lengths'], xs['target_lengths'], b,
                                              'tanh', xs['blank'], 0.5, 'sum', 0.01, 0.05) * 3.0
    ins = [xs[k] for k in PARAMS]
    import torch._inductor.config as inductor_config
    with inductor_config.patch(fx_graph_cache=False):
        eager, comp = f(*ins), torch.compile(f, fullgraph=True)(*ins)
    torch.testing.assert_close(comp, eager)
    for a, b in zip(torch.autograd.grad(comp, ins), torch.autograd.grad(eager, ins)): torch.testing.assert_close(a, b)

def test_the_op_and_its_backward_op_pass_opcheck():
    "The custom op and its backward op (what a compiled graph calls): schemas, fakes, no aliasing outputs."
    case = random_case(random.Random(9), bias=True)
    args = [case[k].requires_grad_() if k in PARAMS else case[k] for k in PARAMS + ('targets', 'logit_lengths', 'target_lengths')]
    opts = ('relu', case['blank'] % case['weight'].shape[0], -1.0, 0.0, 0.0, 1000)
    torch.library.opcheck(joint_rnnt_op.custom_op, (*args, *opts, 'cpu'))
    outs = [o.detach() for o in joint_rnnt_op.custom_op(*args, *opts, "cpu")]
    g = torch.rand(outs[0].shape, dtype=outs[0].dtype)
    torch.library.opcheck(joint_rnnt_op.backward_op, (*[a.detach() for a in args], *opts, *outs, g, None, None, 'cpu'))

e0, p0, W0, b0 = torch.randn(2, 4, 3), torch.randn(2, 3, 3), torch.randn(5, 3), torch.randn(5)
y0, il0, tl0 = torch.tensor([[1, 2], [3, 1]]), torch.tensor([4, 3]), torch.tensor([2, 1])
BAD = [
    (dict(encoder_out=e0[0]), ValueError, r"encoder_out must have shape \(B, T, H\), got \(4, 3\)"),
    (dict(encoder_out=e0.long()), TypeError, r"encoder_out must be float16, bfloat16, float32 or float64, got torch.int64"),
    (dict(encoder_out=[1.0]), TypeError, r"encoder_out must be a tensor, got list"),
    (dict(predictor_out=torch.randn(2, 3, 4)), ValueError, r"predictor_out must have shape \(B, U\+1, H\) = \(2, U\+1, 3\) to chain with encoder_out \(2, 4, 3\), got \(2, 3, 4\)"),
    (dict(predictor_out=torch.randn(1, 3, 3)), ValueError, r"predictor_out must have shape \(B, U\+1, H\) = \(2, U\+1, 3\)"),
    (dict(weight=torch.randn(5, 4)), ValueError, r"weight must have shape \(V, H\) = \(V, 3\) to chain with encoder_out \(2, 4, 3\), got \(5, 4\)"),
    (dict(weight=torch.randn(3, 5)), ValueError, r"weight must have shape \(V, H\) = \(V, 3\)"),
    (dict(bias=torch.randn(4)), ValueError, r"bias must have shape \(V,\) = \(5,\) as weight \(5, 3\), got \(4,\)"),
    (dict(bias=torch.randn(5).double()), TypeError, r"bias has dtype torch.float64: it must have encoder_out's, torch.float32"),
    (dict(weight=W0.double()), TypeError, r"weight has dtype torch.float64: it must have encoder_out's, torch.float32"),
    (dict(predictor_out=torch.randn(2, 3, 3, device='meta')), ValueError, r"predictor_out is on meta: it must be on encoder_out's device, cpu"),
    (dict(predictor_out=torch.randn(2, 0, 3)), ValueError, r"B, T, U\+1, H and V must all be >= 1"),
    (dict(blank=5), ValueError, r"blank must be an int in \[-V, V\) = \[-5, 5\) \(negative counts from the end\), got 5"),
    (dict(blank=-6), ValueError, r"blank must be an int in \[-V, V\) = \[-5, 5\)"),
    (dict(activation='gelu'), ValueError, r"activation must be 'relu', 'tanh' or 'identity', got 'gelu'"),
    (dict(logit_lengths=torch.tensor([5, 3])), ValueError, r"logit_lengths must be in \[1, T\] = \[1, 4\], got \[5\]"),
    (dict(logit_lengths=torch.tensor([0, 3])), ValueError, r"logit_lengths must be in \[1, T\] = \[1, 4\], got \[0\]"),
    (dict(target_lengths=torch.tensor([3, 1])), ValueError, r"target_lengths must be in \[0, min\(U, targets.shape\[1\]\)\] = \[0, 2\]"),
    (dict(targets=torch.tensor([[1, 5], [3, 1]])), ValueError, r"targets must hold labels in \[0, V\) = \[0, 5\), got \[5\]"),
    (dict(targets=torch.tensor([[1, 0], [3, 1]])), ValueError, r"targets contain the blank label 0 within their target_lengths"),
    (dict(targets=y0.float()), TypeError, r"targets must hold integers"),
    (dict(logit_lengths=torch.tensor([4, 3, 3])), ValueError, r"logit_lengths must have shape \(2\), got \(3,\)"),
    (dict(reduction='avg'), ValueError, r"reduction must be 'none', 'sum' or 'mean', got 'avg'"),
    (dict(clamp='1'), TypeError, r"clamp must be a real number, got '1'"),
    (dict(fastemit_lambda=-0.1), ValueError, r"fastemit_lambda must be >= 0, got -0.1"),
    (dict(delay_penalty=math.inf), ValueError, r"delay_penalty must be finite, got inf"),
    (dict(tile_bytes=0), ValueError, r"tile_bytes must be a positive int, got 0"),
    (dict(backend='gpu'), ValueError, r"backend must be 'auto', .*'reference', got 'gpu'"),
]

@pytest.mark.parametrize('bad,error,message', BAD)
def test_bad_input_is_a_clear_error(bad, error, message):
    args = dict(encoder_out=e0, predictor_out=p0, weight=W0, bias=b0, targets=y0, logit_lengths=il0, target_lengths=tl0, blank=0)
    args.update(bad)
    with pytest.raises(error, match=message): joint_rnnt_loss(**args)

def test_workers_agree_and_repeat():
    """Past a million logits the CPU tiles are shared among torch's threads (each single-threaded, partial sums added
    in a fixed order): the composition's result in float64, bitwise repeatable, and torch's thread count restored."""
    g = torch.Generator().manual_seed(11)
    B, T, U, V, H = 3, 50, 20, 400, 8
    assert B * T * (U + 1) * V >= joint._PARALLEL_MIN
    case = dict(encoder_out=torch.randn(B, T, H, generator=g, dtype=torch.float64),
                predictor_out=torch.randn(B, U + 1, H, generator=g, dtype=torch.float64),
                weight=torch.randn(V, H, generator=g, dtype=torch.float64), bias=torch.randn(V, generator=g, dtype=torch.float64),
                targets=torch.randint(1, V, (B, U), generator=g), logit_lengths=torch.tensor([50, 31, 44]),
                target_lengths=torch.tensor([20, 9, 17]), blank=0)
    threads = torch.get_num_threads()
    want = loss_and_grads(case, backend='reference', activation='tanh', fastemit_lambda=0.1)
    got = loss_and_grads(case, backend='cpu', activation='tanh', fastemit_lambda=0.1, tile_bytes=20000)
    assert_relative(got, want, 1e-9)
    again = loss_and_grads(case, backend='cpu', activation='tanh', fastemit_lambda=0.1, tile_bytes=20000)
    for a, b in zip(got, again): assert torch.equal(a, b)
    assert torch.get_num_threads() == threads and ops._POOL            # (the workers ran, in the shared pool)

# The CUDA path, run by the emulator on CPU tensors (small shapes): tiles over the padded grid flattened (runs of
# frames f = b T + t, across utterances), the per-tile kernels in joint.cu.

@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_cuda_path_agrees_with_the_composition(dtype):
    "Randomised cases (every option), tiles of a few rows, blocks of 64 threads (rows longer than a block)."
    rng = random.Random(21)
    for i in range(6):
        case = random_case(rng, max_B=3, max_T=6, max_U=4, max_V=90, max_H=5)
        low = {k: (v.to(dtype) if k in PARAMS and v is not None else v) for k, v in case.items()}
        kw = options(rng)
        if kw['clamp'] > 0: kw['delay_penalty'] = 0.0
        want = loss_and_grads(case, **kw, backend='reference')
        with launch_limits(max_threads=64):
            got = loss_and_grads(low, **kw, backend='cuda', tile_bytes=rng.choice([None, 400]))
        assert_relative([x.double() for x in got], want, 1e-9 if dtype == torch.float64 else 2e-5, f"case {i} {kw}")

def test_cuda_path_ignores_garbage_padding():
    "NaN in the encoder frames and predictor steps past each utterance's lengths: the tiles cover them, nothing leaks."
    case = random_case(random.Random(22), max_B=3, max_T=6, max_U=4, max_V=12, bias=True)
    case['logit_lengths'][0], case['target_lengths'][0] = 1, 0
    dirty = dict(case)
    dirty['encoder_out'] = case['encoder_out'].clone()
    dirty['encoder_out'][0, 1:] = math.nan
    dirty['predictor_out'] = case['predictor_out'].clone()
    dirty['predictor_out'][0, 1:] = math.nan
    want = loss_and_grads(case, backend='cpu')
    got = loss_and_grads(dirty, backend='cuda')
    got[1][0, 1:] = 0; got[2][0, 1:] = 0                  # (the padding's own gradient: zero in both)
    assert_relative(got, want, 1e-9)
    got_cpu = loss_and_grads(dirty, backend='cpu')        # (the CPU tiles never read the padding)
    assert_relative(got_cpu, want, 0)

def test_cuda_tiles_run_across_utterances_over_nan_padding():
    """The CUDA tiles are runs of the flat grid's frames f = b T + t: tiles that straddle utterances, tiles that hold
    three, frames split along u. Uneven lengths (one utterance of one frame, one without labels) with NaN in the
    padding of encoder_out and predictor_out: the reference's loss and four gradients on clean inputs (the padding's
    gradients zero, as the composition's), every activation, bitwise repeatable."""
    g = torch.Generator().manual_seed(31)
    B, T, U, V, H = 4, 7, 4, 37, 6
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    il, tl = torch.tensor([7, 3, 5, 1]), torch.tensor([4, 0, 2, 3])
    case = dict(encoder_out=r(B, T, H), predictor_out=r(B, U + 1, H), weight=r(V, H), bias=r(V),
                targets=torch.randint(1, V, (B, U), generator=g), logit_lengths=il, target_lengths=tl, blank=0)
    dirty = dict(case, encoder_out=case['encoder_out'].clone(), predictor_out=case['predictor_out'].clone())
    for b in range(B):
        dirty['encoder_out'][b, il[b]:] = math.nan
        dirty['predictor_out'][b, tl[b] + 1:] = math.nan
    row = V * 8
    for act, frames in (('relu', 3), ('tanh', 15), ('identity', 10), ('tanh', 0.4)):    # 0.4: 2 of a frame's 5 rows
        kw = dict(activation=act, fastemit_lambda=0.1, reduction='none')
        want = loss_and_grads(case, **kw, backend='reference')
        with launch_limits(max_threads=64):
            got = loss_and_grads(dirty, **kw, backend='cuda', tile_bytes=int(frames * (U + 1)) * row)
            again = loss_and_grads(dirty, **kw, backend='cuda', tile_bytes=int(frames * (U + 1)) * row)
        assert_relative(got, want, 1e-9, f"{act} {frames} frames a tile")
        for a, b in zip(got, again): assert torch.equal(a, b)

def test_cuda_tile_share_from_the_environment(monkeypatch):
    "A CUDA tile holds 1/8 of the logits (at most 64 MiB), or 1/SEQDIST_JOINT_TILE_SHARE, read at each call; tile_bytes wins."
    from types import SimpleNamespace
    s = SimpleNamespace(shape=(8, 150, 41, 4096), e=torch.empty(0), tile_bytes=0, workers=1)
    logits, row = 8 * 150 * 41 * 4096 * 4, 4096 * 4
    monkeypatch.delenv('SEQDIST_JOINT_TILE_SHARE', raising=False)
    assert joint._tile_rows(s, 'cuda') == min(logits // joint.JOINT_CUDA_TILE_SHARE, joint.JOINT_CUDA_TILE_BYTES) // row
    for share in (4, 8, 32):
        monkeypatch.setenv('SEQDIST_JOINT_TILE_SHARE', str(share))
        assert joint._tile_rows(s, 'cuda') == min(logits // share, joint.JOINT_CUDA_TILE_BYTES) // row
    assert joint._tile_rows(s, 'cpu') == joint.JOINT_TILE_BYTES // row          # (the CPU's bound is its own)
    assert joint._tile_rows(SimpleNamespace(**{**vars(s), 'tile_bytes': 10 * row}), 'cuda') == 10
    for bad in ('2', 'x', '-8'):
        monkeypatch.setenv('SEQDIST_JOINT_TILE_SHARE', bad)
        with pytest.raises(ValueError, match=r"SEQDIST_JOINT_TILE_SHARE must be an integer >= 4"): joint._tile_rows(s, 'cuda')

def test_cuda_path_half_precision():
    "bf16 inputs through the CUDA source: float32 arithmetic, gradients in bf16."
    case = random_case(random.Random(23), dtype=torch.bfloat16, max_V=12, bias=True)
    got = loss_and_grads(case, backend='cuda')
    assert all(g.dtype == torch.bfloat16 for g in got)
    want = loss_and_grads({k: (v.float() if k in PARAMS else v) for k, v in case.items()}, backend='cpu')
    for a, b in zip(got, want): torch.testing.assert_close(a.float(), b, rtol=2 ** -6, atol=2 ** -6 * b.abs().max().item())

@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('backend', ['cuda', 'cpu'])
def test_half_precision_gemms(dtype, backend, monkeypatch):
    """The GPU's path for half-precision inputs (`_HALF_GEMMS`, forced here on the CPU): the tiles' products in that
    dtype, the rest in float32: the composition's loss and gradients in that dtype, within its rounding."""
    monkeypatch.setattr(joint, '_HALF_GEMMS', {'cpu'})
    case = random_case(random.Random(29), dtype=dtype, max_V=12, bias=True)
    got = loss_and_grads(case, backend=backend, tile_bytes=3 * 12 * 4)          # (tiles of 3 rows: several a call)
    assert all(g.dtype == dtype for g in got[1:])
    want = loss_and_grads({k: (v.float() if k in PARAMS else v) for k, v in case.items()}, backend='cpu')
    for a, b in zip(got, want): torch.testing.assert_close(a.float(), b, rtol=2 ** -6, atol=2 ** -6 * b.abs().max().item())

def test_lengths_and_labels_are_checked_once_per_forward_and_backward(monkeypatch):
    """The joint's prepare checks and cleans the targets, once per fwd+bwd; the lattice (forward, then the posteriors)
    and the reference's composition run rnnt's ops on them without checks."""
    import seqdist.rnnt as rnnt
    calls, clean = [], rnnt.clean_targets
    monkeypatch.setattr(joint, 'clean_targets', lambda *args: calls.append(('joint', args[-1])) or clean(*args))
    monkeypatch.setattr(rnnt, 'clean_targets', lambda *args: calls.append(('rnnt', args[-1])) or clean(*args))
    case = random_case(random.Random(3), bias=True)
    for backend, inner in (('cpu', 2), ('cuda', 2), ('reference', 1)):
        for kw in ({}, dict(delay_penalty=0.1)):
            calls.clear()
            loss_and_grads(case, backend=backend, **kw)
            assert calls == [('joint', True)] + [('rnnt', False)] * inner, (backend, kw, calls)
