"""The op layer (seqdist.ops): what every family's op relies on. A toy op (row log-sum-exp, with a residual output)
declared as the families declare theirs, checked for backend resolution, gradients on every path (eager, compiled,
reference by autograd), the state handed from the forward to the backward (prepared and checked once), and the
declaration's own errors."""
import collections, itertools
from types import SimpleNamespace
import pytest, torch
from seqdist.ops import Op, AUTOGRAD, launch_limits, max_threads, resolve_backend

_names = (f'seqdist_test::toy{i}' for i in itertools.count())
CALLS = collections.Counter()          # (backend, check) -> prepare calls; ('backward', backend) -> backward calls

def toy_op(name=None, residuals=('argmax',)):
    """lse (N,) and argmax (N,) of each row of x (N, D), times a scale; differentiable w.r.t. x and scale."""
    def prepare(a, backend, check):
        CALLS[backend, check] += 1
        if check and a.x.dim() != 2: raise ValueError(f"x must be (N, D), got {tuple(a.x.shape)}")
        x = a.x if backend == 'reference' else a.x.detach()
        return SimpleNamespace(x=x, scale=a.scale if backend == 'reference' else a.scale.detach(), rows=a.x.shape[0])
    def forward(s):
        lse = torch.logsumexp(s.x, 1)
        return lse * s.scale, s.x.argmax(1)
    def backward(s, outputs, grads):
        CALLS['backward', s.backend if hasattr(s, 'backend') else 'kernel'] += 1
        (out, argmax), (g, g_argmax) = outputs, grads
        assert g_argmax is None, "a residual's gradient is None"
        lse = out / s.scale
        wanted = {}
        if 'x' in s.grad_wanted: wanted['x'] = torch.softmax(s.x, 1) * (g * s.scale)[:, None]
        if 'scale' in s.grad_wanted: wanted['scale'] = (g * lse).sum().reshape(s.scale.shape)
        return wanted
    return Op(name or next(_names), '(Tensor x, Tensor scale) -> (Tensor lse, Tensor argmax)', prepare=prepare,
              forward={'cpu': forward, 'cuda': forward, 'reference': forward},
              backward={'cpu': backward, 'cuda': backward, 'reference': AUTOGRAD},
              fake=lambda a, backend: (a.x.new_empty(a.x.shape[0]), a.x.new_empty(a.x.shape[0], dtype=torch.long)),
              differentiable=('x', 'scale'), residuals=residuals)

TOY = toy_op()

def expected(x, scale):
    x, scale = x.detach().requires_grad_(), scale.detach().requires_grad_()
    lse = torch.logsumexp(x, 1) * scale
    return lse.detach(), torch.autograd.grad(lse.sum(), (x, scale))

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference', 'auto'])
def test_values_and_gradients_on_every_backend(backend):
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    lse, argmax = TOY(x, scale, backend=backend)
    assert not argmax.requires_grad
    want, (gx, gs) = expected(x, scale)
    torch.testing.assert_close(lse, want)
    got = torch.autograd.grad(lse.sum(), (x, scale))
    torch.testing.assert_close(got[0], gx)
    torch.testing.assert_close(got[1], gs)
    assert torch.autograd.gradcheck(lambda x, s: TOY(x, s, backend=backend)[0], (x, scale))

def test_prepared_and_checked_once_per_forward_and_backward():
    "Eagerly, the backward gets the forward's state: `prepare` runs once, with its checks, per forward+backward."
    x = torch.randn(4, 3, requires_grad=True)
    for backend in ('cpu', 'cuda', 'reference'):
        CALLS.clear()
        TOY(x, torch.tensor(2.0), backend=backend)[0].sum().backward()
        assert CALLS[backend, True] == 1 and CALLS[backend, False] == 0, (backend, CALLS)

def test_compiled_matches_eager_and_checks_once():
    "Under torch.compile the custom op and its backward op run; the backward prepares again, without checks."
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    f = torch.compile(lambda x, s: TOY(x, s)[0].sum(), fullgraph=True, backend='aot_eager')
    f(x, scale)                                            # traced (the fake runs), then run
    CALLS.clear()
    gx, gs = torch.autograd.grad(f(x, scale), (x, scale))
    want, (ex, es) = expected(x, scale)
    torch.testing.assert_close(gx, ex); torch.testing.assert_close(gs, es)
    assert CALLS['cpu', True] == 1 and CALLS['cpu', False] == 1, CALLS

def test_only_wanted_gradients_are_computed():
    x = torch.randn(3, 4, requires_grad=True)
    scale = torch.tensor(2.0)                              # no gradient wanted
    lse, _ = TOY(x, scale, backend='cpu')
    gx, = torch.autograd.grad(lse.sum(), x)
    torch.testing.assert_close(gx, torch.softmax(x, 1) * 2)

def test_unused_output_and_no_grad():
    x = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        lse, argmax = TOY(x, torch.tensor(1.0))
    assert not lse.requires_grad
    lse, argmax = TOY.compute(x, torch.tensor(1.0))
    assert not lse.requires_grad and torch.equal(argmax, x.argmax(1))

def test_calls_with_nothing_to_differentiate_skip_autograd(monkeypatch):
    """With no gradient to record (no_grad, or no differentiable input requiring one) the forward runs without the
    autograd.Function: same outputs, nothing saved, less host time (inference calls)."""
    x = torch.randn(3, 4, dtype=torch.float64)
    want = TOY(x, torch.tensor(1.5, dtype=torch.float64))
    import seqdist.ops
    def no_function(*args): raise AssertionError("the autograd.Function ran with nothing to differentiate")
    monkeypatch.setattr(seqdist.ops._Eager, 'apply', no_function)
    for backend in ('cpu', 'cuda'):
        CALLS.clear()
        got = TOY(x, torch.tensor(1.5, dtype=torch.float64), backend=backend)          # no input requires grad
        with torch.no_grad(): got_no_grad = TOY(x.requires_grad_(), torch.tensor(1.5, dtype=torch.float64), backend=backend)
        x.requires_grad_(False)
        for g in (got, got_no_grad):
            torch.testing.assert_close(g[0], want[0]); assert torch.equal(g[1], want[1]) and g[0].grad_fn is None
        assert CALLS[backend, True] == 2, CALLS                # checked once per call all the same
    with pytest.raises(AssertionError, match="autograd.Function ran"):
        TOY(x.requires_grad_(), torch.tensor(1.5, dtype=torch.float64), backend='cpu')

@pytest.mark.parametrize('backend, message', [
    ('gpu', "backend must be 'auto', 'cpu', 'cuda' or 'reference', got 'gpu'"),
    ('', "backend must be 'auto', 'cpu', 'cuda' or 'reference', got ''")])
def test_bad_backend(backend, message):
    with pytest.raises(ValueError, match=message): TOY(torch.randn(2, 2), torch.tensor(1.0), backend=backend)

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
def test_check_false_prepares_without_checks(backend):
    "An op run inside another's forward or backward, on values the outer op checked: prepared once, unchecked."
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(2.0, dtype=torch.float64)
    CALLS.clear()
    lse, _ = TOY(x, scale, backend=backend, check=False)
    gx, = torch.autograd.grad(lse.sum(), x)
    want, (ex, _) = expected(x, scale)
    torch.testing.assert_close(lse, want); torch.testing.assert_close(gx, ex)
    assert TOY.compute(x, scale, backend=backend, check=False)[0].equal(lse.detach())
    assert CALLS[backend, False] == 2 and CALLS[backend, True] == 0, CALLS
    assert torch.autograd.gradcheck(lambda x: TOY(x, scale, backend=backend, check=False)[0], (x,))

def test_parallel_for():
    """Every index of the batch is visited once, by slices: on one thread below PARALLEL_MIN elements of work, on
    torch's thread count from there on (slices in other threads); a worker's exception reaches the caller."""
    import threading, numba, numpy as np
    from seqdist.ops import parallel_for, cpu_threads, PARALLEL_MIN
    assert cpu_threads(PARALLEL_MIN - 1) == 1 and cpu_threads(PARALLEL_MIN) == torch.get_num_threads()
    @numba.njit(nogil=True)
    def add_index(out, lo, hi):
        for i in range(lo, hi): out[i] += i
    for n, work in ((0, PARALLEL_MIN), (1, PARALLEL_MIN), (7, 10), (1001, PARALLEL_MIN)):
        out = np.zeros(n, np.int64)
        parallel_for(add_index, n, out, work=work)
        assert (out == np.arange(n)).all(), (n, work)
    seen, lock = [], threading.Lock()
    def record(lo, hi):
        with lock: seen.append((threading.get_ident(), lo, hi))
    parallel_for(record, 100, work=1)
    assert [(lo, hi) for _, lo, hi in seen] == [(0, 100)] and seen[0][0] == threading.get_ident()
    seen.clear()
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parallel_for(record, 100, work=PARALLEL_MIN)
        assert sorted((lo, hi) for _, lo, hi in seen) == [(0, 12), (12, 25), (25, 38), (38, 50), (50, 62), (62, 75), (75, 88), (88, 100)]
        def fail(lo, hi):
            if lo > 0: raise RuntimeError("a worker failed")
        with pytest.raises(RuntimeError, match="a worker failed"): parallel_for(fail, 100, work=PARALLEL_MIN)
    finally: torch.set_num_threads(old)

def test_bad_input_checked_in_prepare():
    with pytest.raises(ValueError, match=r"x must be \(N, D\), got \(3,\)"): TOY(torch.randn(3), torch.tensor(1.0))
    with pytest.raises(TypeError, match="takes 2 inputs"): TOY(torch.randn(3, 2))
    with pytest.raises(TypeError, match="takes 2 inputs"): TOY.compute(torch.randn(3, 2))

def test_resolve_backend():
    x = torch.zeros(1)
    assert resolve_backend('auto', x) == 'cpu'
    assert resolve_backend('cuda', x) == 'cuda'        # the CUDA source, emulated on CPU tensors
    with pytest.raises(ValueError, match="backend must be 'auto', 'cpu' or 'cuda', got 'reference'"):
        resolve_backend('reference', x, ('cpu', 'cuda'))

def test_declaration_errors():
    with pytest.raises(ValueError, match="no backward for the backends"):
        Op(next(_names), '(Tensor x) -> Tensor y', prepare=None, forward={'cpu': None}, backward={}, fake=None)
    with pytest.raises(ValueError, match="differentiable names"):
        Op(next(_names), '(Tensor x) -> Tensor y', prepare=None, forward={'cpu': None}, backward={'cpu': None},
           fake=None, differentiable=('z',))
    with pytest.raises(ValueError, match="cannot be optional"):
        Op(next(_names), '(Tensor? x) -> Tensor y', prepare=None, forward={'cpu': None}, backward={'cpu': None}, fake=None)

def test_consumable_residuals_are_handed_to_the_first_backward_and_computed_again_for_later_ones():
    """A gradient the forward computes (softmax of x) is a consumable residual: the first eager backward gets the
    forward's own tensor and scales it in place (one buffer, and what autograd.grad returns); a second backward of the
    same graph (retain_graph) gets it computed again, so both gradients are right and the first is left alone; the
    compiled graph's backward gets consume False and must copy; a consumable that is not a residual is an error."""
    seen, forwards = [], []
    def forward(s):
        forwards.append(1)
        p = torch.softmax(s.x, 1)
        return torch.logsumexp(s.x, 1), p
    def backward(s, outputs, grads):
        seen.append((s.consume, outputs[1].data_ptr()))
        p = outputs[1]
        return {'x': p.mul_(grads[0][:, None]) if s.consume else p * grads[0][:, None]}
    op = Op(next(_names), '(Tensor x) -> (Tensor lse, Tensor p)', prepare=lambda a, backend, check: SimpleNamespace(x=a.x.detach()),
            forward={'cpu': forward}, backward={'cpu': backward}, differentiable=('x',), residuals=('p',), consumable=('p',),
            fake=lambda a, backend: (a.x.new_empty(a.x.shape[0]), torch.empty_like(a.x)))
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    g = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float64)
    want = torch.softmax(x.detach(), 1) * g[:, None]
    lse, p = op(x)
    first, = torch.autograd.grad(lse, x, g, retain_graph=True)
    assert seen[-1] == (True, p.data_ptr()) and first.data_ptr() == p.data_ptr() and len(forwards) == 1
    second, = torch.autograd.grad(lse, x, 2 * g)
    assert seen[-1][0] and seen[-1][1] != p.data_ptr() and len(forwards) == 2
    torch.testing.assert_close(first, want)
    torch.testing.assert_close(second, 2 * want)
    assert torch.autograd.gradcheck(lambda x: op(x)[0], (x,))
    compiled = torch.compile(lambda x: op(x)[0], backend='aot_eager', fullgraph=True)
    torch.testing.assert_close(torch.autograd.grad(compiled(x), x, g)[0], want)
    assert seen[-1][0] is False
    with pytest.raises(ValueError, match="consumable names"):
        Op(next(_names), '(Tensor x) -> (Tensor y, Tensor z)', prepare=None, forward={'cpu': None}, backward={'cpu': None},
           fake=None, differentiable=('x',), residuals=('z',), consumable=('y',))

def test_launch_limits():
    assert max_threads(1024) == 1024
    with launch_limits(max_threads=64):
        assert max_threads(1024) == 64 and max_threads(32) == 32
        with launch_limits(max_threads=128): assert max_threads(1024) == 128
        assert max_threads(1024) == 64
    assert max_threads(1024) == 1024

def test_an_op_without_gradients_for_compute():
    "An op with no differentiable input (alignments) declares no backward; its outputs never require grad."
    op = Op(next(_names), '(Tensor x) -> Tensor best', prepare=lambda a, backend, check: a,
            forward={'cpu': lambda s: (s.x.argmax(1),), 'reference': lambda s: (s.x.argmax(1),)},
            fake=lambda a, backend: (a.x.new_empty(a.x.shape[0], dtype=torch.long),))
    x = torch.randn(3, 4, requires_grad=True)
    best, = op(x)
    assert not best.requires_grad and torch.equal(best, x.argmax(1))
    f = torch.compile(lambda x: op.compute(x)[0], fullgraph=True, backend='aot_eager')
    assert torch.equal(f(x), x.argmax(1))

def test_the_reference_runs_eagerly_when_compiled():
    "A reference with a backward of its own (not AUTOGRAD) may differentiate by autograd inside it: never in the op."
    def prepare(a, backend, check): return SimpleNamespace(x=a.x.detach())
    def backward(s, outputs, grads):
        with torch.enable_grad():
            x = s.x.requires_grad_()
            return {'x': torch.autograd.grad(torch.logsumexp(x, 1), x, grads[0])[0]}
    op = Op(next(_names), '(Tensor x) -> Tensor lse', prepare=prepare, forward={'reference': lambda s: (torch.logsumexp(s.x, 1),)},
            backward={'reference': backward}, fake=lambda a, backend: (a.x.new_empty(a.x.shape[0]),), differentiable=('x',))
    x = torch.randn(3, 4, requires_grad=True)
    f = torch.compile(lambda x: op(x, backend='reference')[0].sum(), backend='aot_eager')
    g, = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(g, torch.softmax(x, 1))

# Every family: each input check (a `require`, counted by its message) runs once per forward+backward: the op layer
# hands the forward's prepared state to the backward. Small inputs, every backend.
def _family_calls():
    from seqdist.ctc import ctc_loss
    from seqdist.rnnt import rnnt_loss
    from seqdist.tdt import tdt_loss
    from seqdist.cross_entropy import cross_entropy, linear_cross_entropy
    from seqdist.joint import joint_rnnt_loss
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(12, 3, 6, generator=g).log_softmax(2).requires_grad_()
    ctc = lambda b: ctc_loss(lp, torch.tensor([[1, 2, 2], [3, 1, 0], [4, 0, 0]]), torch.tensor([12, 9, 5]), torch.tensor([3, 2, 1]), backend=b)
    x = torch.randn(2, 5, 3, 6, generator=g, requires_grad=True)
    y, il, tl = torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 4]), torch.tensor([2, 1])
    rnnt = lambda b: rnnt_loss(x, y, il, tl, blank=0, backend=b)
    xt = torch.randn(2, 5, 3, 6 + 3, generator=g, requires_grad=True)
    tdt = lambda b: tdt_loss(xt, y, il, tl, durations=(0, 1, 2), backend=b)
    z = torch.randn(7, 11, generator=g, requires_grad=True)
    t = torch.tensor([1, 2, 3, -100, 5, 6, 7])
    ce = lambda b: cross_entropy(z, t, backend=b)
    h, W = torch.randn(7, 4, generator=g, requires_grad=True), torch.randn(11, 4, generator=g, requires_grad=True)
    lce = lambda b: linear_cross_entropy(h, W, t, backend=b)
    e, p, Wj = (torch.randn(2, 5, 4, generator=g, requires_grad=True), torch.randn(2, 3, 4, generator=g, requires_grad=True),
                torch.randn(6, 4, generator=g, requires_grad=True))
    joint = lambda b: joint_rnnt_loss(e, p, Wj, y, il, tl, blank=0, backend=b)
    return {'ctc_loss': ctc, 'rnnt_loss': rnnt, 'tdt_loss': tdt, 'cross_entropy': ce, 'linear_cross_entropy': lce,
            'joint_rnnt_loss': joint}

@pytest.mark.parametrize('backend', ['cpu', 'cuda', 'reference'])
@pytest.mark.parametrize('family', ['ctc_loss', 'rnnt_loss', 'tdt_loss', 'cross_entropy', 'linear_cross_entropy',
                                    'joint_rnnt_loss'])
def test_each_input_check_runs_once_per_forward_and_backward(family, backend):
    from seqdist.checks import count_checks
    loss = _family_calls()[family]
    with count_checks() as counts:
        loss(backend).sum().backward()
    twice = {k: n for k, n in counts.items() if n > 1}
    assert not twice, f"{family} ({backend}): checks run more than once: {twice}"

def test_env_choice_reads_the_variable_at_each_call(monkeypatch):
    "A kernel variant from the environment: the first choice when unset or empty, the value when one of the choices, else refused by name."
    from seqdist.ops import env_choice
    monkeypatch.delenv('SEQDIST_TEST_VARIANT', raising=False)
    assert env_choice('SEQDIST_TEST_VARIANT', ('a', 'b', 'c')) == 'a'
    monkeypatch.setenv('SEQDIST_TEST_VARIANT', '')
    assert env_choice('SEQDIST_TEST_VARIANT', ('a', 'b', 'c')) == 'a'
    monkeypatch.setenv('SEQDIST_TEST_VARIANT', 'c')
    assert env_choice('SEQDIST_TEST_VARIANT', ('a', 'b', 'c')) == 'c'
    monkeypatch.setenv('SEQDIST_TEST_VARIANT', 'd')
    with pytest.raises(ValueError, match="SEQDIST_TEST_VARIANT must be 'a', 'b' or 'c', got 'd'"):
        env_choice('SEQDIST_TEST_VARIANT', ('a', 'b', 'c'))
    with pytest.raises(ValueError, match="SEQDIST_TEST_VARIANT must be 'a' or 'b', got 'd'"):
        env_choice('SEQDIST_TEST_VARIANT', ('a', 'b'))
