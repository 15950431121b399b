"""GRU: equals nn.GRU (same weights) for every option combination; the three paths (reference, numba, CUDA source
in the emulator) agree; gradcheck; variable lengths and packed input; edge cases, bad inputs, torch.compile,
low precision, determinism, state dicts."""
import itertools, math, re, pytest, torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
import seqdist.gru as sgru
import seqdist.benchmarks.gru as gru_benchmarks
from seqdist.gru import GRU, gru, gru_layer, gru_layer_reference
from seqdist.utils import emulator_options, count_launches

def pair(I, H, dtype=torch.float64, backend='auto', **kw):
    "An nn.GRU and our GRU with the same weights."
    anchor = nn.GRU(I, H, **kw).to(dtype)
    ours = GRU(I, H, backend=backend, **kw).to(dtype)
    ours.load_state_dict(anchor.state_dict())
    return anchor, ours

def outputs_and_grads(model, x, hx=None, **kw):
    "Output, h_n and the gradients of a random-weighted sum of both w.r.t. the input, hx and every parameter."
    x = x.detach().requires_grad_()
    wrt = [x] + ([hx.detach().requires_grad_()] if hx is not None else [])
    y, h = model(x, wrt[1] if hx is not None else None, **kw)
    g = torch.Generator().manual_seed(1)
    yd = y.data if hasattr(y, 'batch_sizes') else y
    loss = (yd * torch.randn(yd.shape, generator=g).to(yd.dtype)).sum() + (h * torch.randn(h.shape, generator=g).to(h.dtype)).sum()
    grads = torch.autograd.grad(loss, wrt + list(model.parameters()))
    return [yd.detach(), h.detach(), *grads]

def assert_rel(ours, theirs, tol):
    "Each tensor within tol of the other, relative to the largest magnitude in it."
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
        assert err <= tol, f"relative difference {err:.2e} > {tol:.0e}"

COMBOS = list(itertools.product([1, 2], [False, True], [False, True], [True, False], [False, True]))

@pytest.mark.parametrize('layers,bidirectional,batch_first,bias,with_hx', COMBOS)
def test_equals_nn_gru_every_option(layers, bidirectional, batch_first, bias, with_hx):
    "float64 within 1e-12 and float32 within 1e-5 of nn.GRU (outputs, h_n, gradients of input, hx and weights)."
    torch.manual_seed(layers * 16 + bidirectional * 8 + batch_first * 4 + bias * 2 + with_hx)
    T, N, I, H = 7, 3, 5, 6
    D = 2 if bidirectional else 1
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        anchor, ours = pair(I, H, dtype, num_layers=layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional)
        x = torch.randn((N, T, I) if batch_first else (T, N, I), dtype=dtype)
        hx = torch.randn(layers * D, N, H, dtype=dtype) if with_hx else None
        assert_rel(outputs_and_grads(ours, x, hx), outputs_and_grads(anchor, x, hx), tol)

def test_float32_within_1e5_at_a_longer_sequence():
    torch.manual_seed(0)
    anchor, ours = pair(16, 32, torch.float32, num_layers=2, bidirectional=True)
    x, hx = torch.randn(120, 4, 16), torch.randn(4, 4, 32)
    assert_rel(outputs_and_grads(ours, x, hx), outputs_and_grads(anchor, x, hx), 1e-5)

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
@pytest.mark.parametrize('bidirectional', [False, True])
def test_packed_sequences_equal_nn_gru(backend, bidirectional):
    "PackedSequence in, PackedSequence out (same data order, batch sizes and indices), h_n at each sequence's end."
    torch.manual_seed(3)
    anchor, ours = pair(4, 5, num_layers=2, bidirectional=bidirectional, backend=backend)
    T, N = 9, 4
    lengths = torch.tensor([5, 9, 1, 7])
    x = torch.randn(T, N, 4, dtype=torch.float64)
    hx = torch.randn(2 * (2 if bidirectional else 1), N, 5, dtype=torch.float64)
    for enforce_sorted, lens, xx in ((False, lengths, x), (True, lengths.sort(descending=True)[0], x[:, lengths.sort(descending=True)[1]])):
        packed = pack_padded_sequence(xx, lens, enforce_sorted=enforce_sorted)
        def run(m):
            data = packed.data.detach().requires_grad_()
            p = torch.nn.utils.rnn.PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
            h0 = hx.detach().requires_grad_()
            y, h = m(p, h0)
            assert torch.equal(y.batch_sizes, packed.batch_sizes)
            assert (y.sorted_indices is None) == (packed.sorted_indices is None)
            loss = (y.data ** 2).sum() + (h * torch.arange(h.numel()).view(h.shape)).sum()
            return [y.data.detach(), h.detach(), *torch.autograd.grad(loss, [data, h0, *m.parameters()])]
        assert_rel(run(ours), run(anchor), 1e-12)

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
def test_lengths_argument_equals_packing_and_ignores_padding(backend):
    "`lengths=` on a padded batch gives the packed result; padding holds garbage that must not matter."
    torch.manual_seed(4)
    anchor, ours = pair(3, 4, bidirectional=True, batch_first=True, backend=backend)
    N, T = 3, 8
    lengths = torch.tensor([8, 3, 6])
    x = torch.randn(N, T, 3, dtype=torch.float64)
    pad = torch.arange(T)[None] >= lengths[:, None]
    garbage = torch.where(pad[..., None], torch.full_like(x, 1e3), x)
    y, h = ours(garbage, lengths=lengths)
    ya, ha = anchor(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
    ya, _ = pad_packed_sequence(ya, batch_first=True, total_length=T)
    torch.testing.assert_close(y, ya, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(h, ha, rtol=1e-12, atol=1e-14)
    assert (y[pad] == 0).all()

def test_lengths_edge_values():
    "lengths = T everywhere equals no lengths; a zero length gives zero outputs and h_n = hx."
    torch.manual_seed(5)
    _, ours = pair(3, 4, bidirectional=True)
    x, hx = torch.randn(5, 2, 3, dtype=torch.float64), torch.randn(2, 2, 4, dtype=torch.float64)
    y0, h0 = ours(x, hx)
    y1, h1 = ours(x, hx, lengths=torch.tensor([5, 5]))
    assert torch.equal(y0, y1) and torch.equal(h0, h1)
    y2, h2 = ours(x, hx, lengths=[0, 5])
    assert (y2[:, 0] == 0).all() and torch.equal(h2[:, 0], hx[:, 0]) and torch.equal(y2[:, 1], y0[:, 1])

CASES = [  # T, N, I, H, lengths: T=1, N=1, and N*H above one 256-thread block (the CUDA grid's several blocks)
    (1, 1, 2, 3, None), (6, 1, 3, 4, [4]), (4, 3, 5, 130, [4, 1, 3]), (5, 2, 7, 9, [5, 2])]

@pytest.mark.parametrize('T,N,I,H,lengths', CASES)
def test_three_paths_agree(T, N, I, H, lengths):
    "reference, cpu (numba) and cuda (the CUDA source, emulated, in several thread orders) on one layer, both directions."
    torch.manual_seed(6)
    x, h0 = torch.randn(T, N, I, dtype=torch.float64), torch.randn(N, H, dtype=torch.float64)
    w = [torch.randn(3 * H, I, dtype=torch.float64) * 0.5, torch.randn(3 * H, H, dtype=torch.float64) * 0.5,
         torch.randn(3 * H, dtype=torch.float64), torch.randn(3 * H, dtype=torch.float64)]
    lens = torch.tensor(lengths) if lengths is not None else None
    def run(backend, reverse):
        args = [a.detach().requires_grad_() for a in (x, h0, *w)]
        y, h = gru_layer(*args, lengths=lens, reverse=reverse, backend=backend)
        loss = (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)).sum() + h.sum()
        return [y.detach(), h.detach(), *torch.autograd.grad(loss, args)]
    for reverse in (False, True):
        ref = run('reference', reverse)
        assert_rel(run('cpu', reverse), ref, 1e-12)
        for seed in (0, 1):
            with emulator_options(seed=seed): assert_rel(run('cuda', reverse), ref, 1e-12)

def test_three_paths_agree_in_float32():
    "float32: numba (gates in float64) and the emulated CUDA kernels (gates in float32) within 1e-5 of the reference."
    torch.manual_seed(16)
    T, N, I, H = 6, 3, 4, 90
    args = [torch.randn(T, N, I), torch.randn(N, H), torch.randn(3 * H, I) * 0.3, torch.randn(3 * H, H) * 0.1,
            torch.randn(3 * H), torch.randn(3 * H)]
    lens = torch.tensor([6, 2, 5])
    def run(backend, reverse):
        a = [t.detach().requires_grad_() for t in args]
        y, h = gru_layer(*a, lengths=lens, reverse=reverse, backend=backend)
        loss = (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum() + h.sum()
        return [y.detach(), h.detach(), *torch.autograd.grad(loss, a)]
    for reverse in (False, True):
        ref = run('reference', reverse)
        assert_rel(run('cpu', reverse), ref, 1e-5)
        assert_rel(run('cuda', reverse), ref, 1e-5)

@pytest.mark.parametrize('backend', ['reference', 'cpu', 'cuda'])
def test_gradcheck(backend):
    torch.manual_seed(7)
    T, N, I, H = 4, 2, 3, 3
    args = [torch.randn(T, N, I, dtype=torch.float64), torch.randn(N, H, dtype=torch.float64),
            torch.randn(3 * H, I, dtype=torch.float64) * 0.5, torch.randn(3 * H, H, dtype=torch.float64) * 0.5,
            torch.randn(3 * H, dtype=torch.float64), torch.randn(3 * H, dtype=torch.float64)]
    args = [a.requires_grad_() for a in args]
    for reverse, lens in ((False, None), (True, torch.tensor([4, 2]))):
        f = lambda *a: gru_layer(*a, lengths=lens, reverse=reverse, backend=backend)
        assert torch.autograd.gradcheck(f, args)

def test_gradcheck_of_the_stack():
    "The whole module (two bidirectional layers, hx) in float64 through the numba path."
    torch.manual_seed(8)
    m = GRU(3, 2, num_layers=2, bidirectional=True).double()
    names = [n for n, _ in m.named_parameters()]
    x, hx = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True), torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
    def f(x, hx, *params):
        out = torch.func.functional_call(m, dict(zip(names, params)), (x, hx))
        return out[0], out[1]
    assert torch.autograd.gradcheck(f, (x, hx, *[p.detach().requires_grad_() for p in m.parameters()]))

def test_unbatched_input():
    torch.manual_seed(9)
    anchor, ours = pair(3, 4, num_layers=2, bidirectional=True)
    x, hx = torch.randn(6, 3, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    for h in (None, hx):
        y, hn = ours(x, h)
        ya, hna = anchor(x, h)
        assert y.shape == ya.shape == (6, 8) and hn.shape == hna.shape == (4, 4)
        torch.testing.assert_close(y, ya, rtol=1e-12, atol=1e-14); torch.testing.assert_close(hn, hna, rtol=1e-12, atol=1e-14)

def test_noncontiguous_inputs_and_inputs_unmodified():
    torch.manual_seed(10)
    anchor, ours = pair(5, 4, batch_first=True)
    base = torch.randn(8, 3, 10, dtype=torch.float64)
    x = base.transpose(0, 1)[:, :, ::2]                        # (3, 8, 5), a strided view
    hx = torch.randn(1, 4, 3, dtype=torch.float64).transpose(1, 2)
    assert not x.is_contiguous() and not hx.is_contiguous()
    before = (base.clone(), hx.clone(), [p.detach().clone() for p in ours.parameters()])
    assert_rel(outputs_and_grads(ours, x, hx), outputs_and_grads(anchor, x, hx), 1e-12)
    assert torch.equal(base, before[0]) and torch.equal(hx, before[1])
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), before[2]))

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_deterministic(backend):
    "The same inputs give bit-identical outputs and gradients."
    torch.manual_seed(11)
    _, ours = pair(4, 5, torch.float32, num_layers=2, bidirectional=True, backend=backend)
    x = torch.randn(6, 3, 4)
    a, b = outputs_and_grads(ours, x), outputs_and_grads(ours, x)
    assert all(torch.equal(u, v) for u, v in zip(a, b))

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype):
    "Outputs and gradients in the input's dtype, equal to the float32 computation rounded."
    torch.manual_seed(12)
    m32 = GRU(4, 8, num_layers=2)
    m16 = GRU(4, 8, num_layers=2).to(dtype)
    m16.load_state_dict(m32.state_dict())
    x = torch.randn(5, 3, 4)
    o32, o16 = outputs_and_grads(m32, x), outputs_and_grads(m16, x.to(dtype))
    for a, b in zip(o16, o32):
        assert a.dtype == dtype
        tol = 1e-2 if dtype == torch.float16 else 4e-2
        assert (a.float() - b).abs().max() <= tol * max(b.abs().max().item(), 1.0)
    m32.load_state_dict({k: v.float() for k, v in m16.state_dict().items()})   # the rounded weights, in float32
    y16, h16 = m16(x.to(dtype))
    y32, h32 = m32(x.to(dtype).float())
    assert torch.equal(y16, y32.to(dtype)) and torch.equal(h16, h32.to(dtype))

def test_state_dict_both_ways_and_module_attributes():
    anchor = nn.GRU(3, 4, num_layers=2, bias=False, bidirectional=True, batch_first=True, dropout=0.25)
    ours = GRU(3, 4, num_layers=2, bias=False, bidirectional=True, batch_first=True, dropout=0.25)
    assert list(ours.state_dict()) == list(anchor.state_dict())
    assert all(ours.state_dict()[k].shape == v.shape for k, v in anchor.state_dict().items())
    ours.load_state_dict(anchor.state_dict())
    anchor2 = nn.GRU(3, 4, num_layers=2, bias=False, bidirectional=True, batch_first=True, dropout=0.25)
    anchor2.load_state_dict(ours.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(anchor2.parameters(), anchor.parameters()))
    assert repr(ours).replace('GRU', '') == repr(anchor).replace('GRU', '')
    assert [len(w) for w in ours.all_weights] == [len(w) for w in anchor.all_weights]
    bound = 1 / math.sqrt(4)
    assert all(p.abs().max() <= bound for p in GRU(3, 4).parameters())

def test_dropout_between_layers_in_training_only():
    "dropout=1 zeroes the second layer's input in training (as nn.GRU); eval mode ignores dropout."
    torch.manual_seed(13)
    anchor, ours = pair(3, 4, num_layers=2, dropout=1.0)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    for mode in (True, False):
        anchor.train(mode); ours.train(mode)
        y, h = ours(x)
        ya, ha = anchor(x)
        torch.testing.assert_close(y, ya, rtol=1e-12, atol=1e-14); torch.testing.assert_close(h, ha, rtol=1e-12, atol=1e-14)

def test_functional_gru_equals_the_module():
    torch.manual_seed(14)
    _, ours = pair(3, 4, num_layers=2, bidirectional=True)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    y, h = gru(x, None, ours._flat_weights, True, 2, 0.0, False, True, False)
    ym, hm = ours(x)
    assert torch.equal(y, ym) and torch.equal(h, hm)

def test_torch_compile_fullgraph_gives_the_eager_result():
    torch.manual_seed(15)
    model = nn.Sequential()
    gru_m, lin = GRU(4, 6, num_layers=2, bidirectional=True), nn.Linear(12, 3)
    def f(x, lengths): return lin(gru_m(x, lengths=lengths)[0]).logsumexp(-1).sum()
    compiled = torch.compile(f, fullgraph=True, backend='aot_eager')
    x, lengths = torch.randn(7, 3, 4, requires_grad=True), torch.tensor([7, 5, 2])
    eager, comp = f(x, lengths), compiled(x, lengths)
    ge = torch.autograd.grad(eager, [x, *gru_m.parameters()])
    gc = torch.autograd.grad(comp, [x, *gru_m.parameters()])
    assert torch.equal(eager, comp) and all(torch.equal(a, b) for a, b in zip(ge, gc))

x0 = torch.randn(5, 2, 3)
BAD = [
    (dict(input=x0[0, 0]), ValueError, r"Expected input to be 2D \(unbatched\) or 3D, got 1D input of shape \(3,\)"),
    (dict(input=x0[None]), ValueError, r"Expected input to be 2D \(unbatched\) or 3D, got 4D"),
    (dict(input=x0.long()), TypeError, r"input must be float16, bfloat16, float32 or float64, got torch.int64"),
    (dict(input=x0.double()), TypeError, r"the weights \(torch.float32\) and the input \(torch.float64\) must have the same dtype"),
    (dict(input=torch.randn(5, 2, 4)), ValueError, r"input.size\(-1\) must be equal to input_size: expected 3, got 4"),
    (dict(input=x0[:0]), ValueError, r"at least one time step and one sequence, got shape \(0, 2, 3\)"),
    (dict(input=[1.0]), TypeError, r"input must be a tensor or a PackedSequence, got list"),
    (dict(hx=torch.zeros(1, 2, 4)), ValueError, r"hx must have shape \(num_layers \* num_directions, N, hidden_size\) = \(2, 2, 4\), got \(1, 2, 4\)"),
    (dict(hx=torch.zeros(2, 3, 4)), ValueError, r"= \(2, 2, 4\), got \(2, 3, 4\)"),
    (dict(hx=torch.zeros(2, 4)), ValueError, r"for batched 3-D input, hx should also be 3-D, got \(2, 4\)"),
    (dict(hx=torch.zeros(2, 2, 4, dtype=torch.float64)), TypeError, r"hx \(torch.float64\) and the input \(torch.float32\) must have the same dtype"),
    (dict(input=x0[:, 0], hx=torch.zeros(2, 1, 4)), ValueError, r"for unbatched 2-D input, hx should also be 2-D"),
    (dict(lengths=torch.tensor([5, 6])), ValueError, r"lengths must be in \[0, T\] = \[0, 5\], got \[6\]"),
    (dict(lengths=torch.tensor([5, -1])), ValueError, r"lengths must be in \[0, T\] = \[0, 5\], got \[-1\]"),
    (dict(lengths=torch.tensor([5])), ValueError, r"lengths must have shape \(2,\), one length per sequence, got \(1,\)"),
    (dict(lengths=torch.tensor([5.0, 5.0])), TypeError, r"lengths must hold integers, got dtype torch.float32"),
    (dict(lengths='5'), TypeError, r"lengths must be a tensor or a list of ints, got str"),
    (dict(input=x0[:, 0], lengths=[5]), ValueError, r"lengths take a batched input"),
]

@pytest.mark.parametrize('kwargs,exc,msg', BAD)
def test_bad_inputs_give_clear_errors(kwargs, exc, msg):
    m = GRU(3, 4, num_layers=2)
    args = dict(input=x0, hx=None, lengths=None)
    args.update(kwargs)
    with pytest.raises(exc, match=msg): m(**args)

BAD_CTOR = [
    (dict(hidden_size=0), r"hidden_size must be a positive int, got 0"),
    (dict(num_layers=0), r"num_layers must be a positive int, got 0"),
    (dict(input_size=2.5), r"input_size must be a positive int, got 2.5"),
    (dict(dropout=1.5), r"dropout must be a number in \[0, 1\]"),
]

@pytest.mark.parametrize('kwargs,msg', BAD_CTOR)
def test_bad_constructor_arguments(kwargs, msg):
    args = dict(input_size=3, hidden_size=4, num_layers=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=msg): GRU(**args)

def test_bad_backend_and_weights():
    x = torch.randn(4, 2, 3)
    m = GRU(3, 4)
    with pytest.raises(ValueError, match=r"backend must be 'auto', 'cpu', 'cuda' or 'reference', got 'gpu'"):
        gru(x, None, m._flat_weights, backend='gpu')
    with pytest.raises(ValueError, match=r"weights must hold 4 tensors \(num_layers=1, 1 direction\(s\), with biases\), got 2"):
        gru(x, None, m._flat_weights[:2])
    with pytest.raises(ValueError, match=r"pass lengths with a padded input, not with a PackedSequence"):
        m(pack_padded_sequence(x, [4, 2]), lengths=[4, 2])

def test_bench_gru_quick_rows():
    rows = gru_benchmarks.bench_gru(quick=True)
    assert len(rows) == 1 and set(rows[0]) == {'op', 'shape', 'anchor', 'anchor_ms', 'ours_ms', 'ratio', 'check'}
    assert rows[0]['ratio'] > 0 and 'rel diff' in rows[0]['check']
    diffs = [float(v) for v in re.findall(r'diff ([0-9.e+-]+)', rows[0]['check'])]
    assert max(diffs) < 1e-5

def test_launch_count_one_gate_kernel_per_step_and_direction():
    "The CUDA path launches exactly one gate kernel per step, direction and layer, forward and backward."
    m = GRU(3, 4, num_layers=2, bidirectional=True, backend='cuda').double()
    with count_launches() as launches: y, h = m(torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True))
    assert launches == {'gru_gates_forward': 5 * 2 * 2}
    with count_launches() as launches: y.sum().backward()
    assert launches == {'gru_gates_backward': 5 * 2 * 2}

def test_gru_kernels_compile_for_gpus():
    from seqdist.utils import gpu_compiler, check_gpu_compile
    if gpu_compiler()[1] is None: pytest.skip("no NVRTC or nvcc: the GPU compile check cannot run here")
    assert check_gpu_compile([k for d in sgru._GATE_KERNELS.values() for k in d.values()]) == []

def test_flatten_parameters_is_accepted():
    m = GRU(3, 4)
    m.flatten_parameters()
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in nn.GRU(3, 4).named_parameters()]

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_nan_and_inf_propagate_as_in_nn_gru(backend):
    "A NaN in one sequence's input gives NaN in that sequence only, as nn.GRU; huge inputs saturate the gates."
    torch.manual_seed(17)
    anchor, ours = pair(3, 4, backend=backend)
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    x[2, 1, 0] = math.nan
    x[1, 2] = 1e300
    with torch.no_grad():
        (y, h), (ya, ha) = ours(x), anchor(x)
    assert torch.equal(torch.isnan(y), torch.isnan(ya)) and torch.isnan(y[2:, 1]).all() and not torch.isnan(y[:, [0, 2]]).any()
    fin = ~torch.isnan(ya)
    torch.testing.assert_close(y[fin], ya[fin], rtol=1e-12, atol=1e-14)

def test_torch_compile_without_bias():
    torch.manual_seed(18)
    m = GRU(4, 6, bias=False)
    def f(x): return m(x)[0].sum()
    compiled = torch.compile(f, fullgraph=True, backend='aot_eager')
    x = torch.randn(5, 2, 4, requires_grad=True)
    ge, gc = (torch.autograd.grad(g(x), [x, *m.parameters()]) for g in (f, compiled))
    assert all(torch.equal(a, b) for a, b in zip(ge, gc))

@pytest.mark.parametrize('backend', ['cpu', 'cuda'])
def test_input_modified_in_place_after_the_forward_raises(backend):
    "As for any PyTorch op: an input modified in place between the forward and the backward is an error, not a wrong gradient."
    x = torch.randn(5, 2, 3, requires_grad=True)
    h = x * 1.0
    y, _ = GRU(3, 4, backend=backend)(h)
    h.mul_(2)
    with pytest.raises(RuntimeError, match='modified by an inplace operation'): y.sum().backward()
