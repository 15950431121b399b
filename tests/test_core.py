"""Semiring laws on random tensors (hypothesis), `dsum` as the gradient of `sum`, and seqdist 0.0.3 compatibility."""
import pytest, torch
from hypothesis import given, settings, strategies as st
from seqdist.core import Log, Max, semiring, grad, max_grad, SequenceDist

def tensors(n):
    shape = st.tuples(st.integers(1, 4), st.integers(1, 6))
    return shape.flatmap(lambda s: st.tuples(*[st.lists(st.floats(-50, 50), min_size=s[0] * s[1], max_size=s[0] * s[1])
                                                   .map(lambda v, s=s: torch.tensor(v, dtype=torch.float64).view(s)) for _ in range(n)]))

def plus(S, *xs): return S.sum(torch.stack(xs), dim=0)
def close(a, b): torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

@pytest.mark.parametrize('S', [Log, Max])
@settings(max_examples=60, deadline=None)
@given(abc=tensors(3))
def test_semiring_laws(S, abc):
    a, b, c = abc
    close(plus(S, plus(S, a, b), c), plus(S, a, plus(S, b, c)))
    close(plus(S, a, b), plus(S, b, a))
    close(S.mul(S.mul(a, b), c), S.mul(a, S.mul(b, c)))
    close(plus(S, a, torch.full_like(a, S.zero)), a)
    close(S.mul(a, torch.full_like(a, S.one)), a)
    close(S.mul(a, plus(S, b, c)), plus(S, S.mul(a, b), S.mul(a, c)))

@pytest.mark.parametrize('S', [Log, Max])
@settings(max_examples=40, deadline=None)
@given(a=tensors(1))
def test_dsum_is_the_gradient_of_sum(S, a):
    (a,) = a
    a = a + torch.arange(a.numel(), dtype=a.dtype).view(a.shape) * 1e-3   # no ties for max
    close(grad(lambda x: S.sum(x, dim=1).sum(), a), S.dsum(a, dim=1))

def test_seqdist_003_compatibility():
    assert semiring._fields == ('zero', 'one', 'mul', 'sum', 'dsum')
    assert (Log.zero, Log.one, Max.zero, Max.one) == (-1e38, 0., -1e38, 0.)
    assert Log.mul is torch.add and Log.sum is torch.logsumexp and Log.dsum is torch.softmax and Max.dsum is max_grad
    mine = semiring(zero=0., one=1., mul=torch.mul, sum=torch.sum, dsum=torch.ones_like)  # 0.0.3-style construction
    assert mine.zero == 0. and mine.name is None and {(torch.float32, Log): 1, (torch.float32, mine): 2}[(torch.float32, Log)] == 1
    with pytest.raises(ValueError, match="has no CUDA implementation"): mine.cuda_macros()
    with pytest.raises(TypeError, match="float32 or float64"): Log.cuda_macros(torch.float16)
    assert Log.cuda_macros(torch.float64)['FLOAT'] == 'double'

def test_grad_works_under_no_grad_and_posteriors():
    class Independent(SequenceDist):
        def logZ(self, scores, S=Log): return S.sum(scores, dim=-1).sum(0)
    s = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        close(Independent().posteriors(s, Log), torch.softmax(s, -1))
        assert torch.equal(Independent().posteriors(s, Max), max_grad(s, 1))
    with pytest.raises(NotImplementedError): SequenceDist().logZ(s)

def test_fast_logsumexp_semirings_by_name_and_compute_dtype():
    import numpy as np
    from seqdist.core import fast_logsumexp, SEMIRINGS, compute_dtype
    rng = np.random.default_rng(0)
    for n in (1, 7, 1000):
        row = rng.normal(0, 30, n)
        want = np.logaddexp.reduce(row)
        assert abs(fast_logsumexp(row, True) - want) <= 1e-13 * max(1.0, abs(want))
        row32 = row.astype(np.float32)
        assert abs(fast_logsumexp(row32, False) - np.logaddexp.reduce(row32.astype(np.float64))) <= 1e-8 * max(1.0, abs(want))
    assert fast_logsumexp(np.empty(0), True) == -np.inf and fast_logsumexp(np.full(3, -np.inf), True) == -np.inf
    assert np.isnan(fast_logsumexp(np.array([1.0, np.nan, 2.0]), True))
    assert SEMIRINGS == {'Log': Log, 'Max': Max}
    assert [compute_dtype(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)] == [torch.float32] * 3 + [torch.float64]


def test_base2_cuda_macros_are_float_logs_alone():
    "Log's base-2 kernels (the recursions' log2 variants): float32 alone, LOG2 defined; other semirings and float64 refused."
    m = Log.cuda_macros(torch.float32, base2=True)
    assert m['LOG2'] == 1 and m['FLOAT'] == 'float' and 'log2sumexp2' in m['SUM(a, b)'] and m['ZERO'] == Log.cuda_macros()['ZERO']
    for S, dtype in ((Log, torch.float64), (Max, torch.float32)):
        with pytest.raises(ValueError, match="base-2 kernels take float32 and a semiring with base-2 sums"):
            S.cuda_macros(dtype, base2=True)
