"""Every declared public call's bad-input table (`seqdist.checks.declared`): each row, one argument broken one way,
must raise a TypeError or ValueError that names that argument, on the CPU kernels and through the emulated CUDA
kernels, never a raw PyTorch or numba error, a crash or an answer. Each function's table runs in a process of its own,
so that a crash (a kernel writing where it should not) fails that function's test instead of the run."""
import json, subprocess, sys, textwrap
import pytest
import seqdist
from seqdist import ctc

MODULES = ['ctc', 'rnnt', 'tdt', 'joint', 'cross_entropy', 'sparse', 'ctc_simple', 'koi_decode', 'koi', 'crf', 'gru', 'decode', 'graph']

def declared_functions():
    import importlib
    out = []
    for m in MODULES:
        mod = importlib.import_module(f'seqdist.{m}')
        for n in sorted(vars(mod)):
            x = getattr(mod, n)
            if hasattr(x, 'declaration') and x.__module__ == mod.__name__: out.append(f'{m}.{n}')
            elif isinstance(x, type) and x.__module__ == mod.__name__:          # a class's declared methods
                out += [f'{m}.{n}.{k}' for k in sorted(vars(x)) if hasattr(getattr(x, k), 'declaration')]
    return out

RUN = textwrap.dedent("""
    import json, importlib, warnings
    warnings.filterwarnings('ignore')
    mod, *names = {target!r}.split('.')
    f = importlib.import_module('seqdist.' + mod)
    for name in names: f = getattr(f, name)
    d = f.declaration
    run = getattr(d, 'call', f)                   # a module (a face of a function): built, then called
    backends = [b for b in ('cpu', 'cuda') if b in d.args['backend'].options] if 'backend' in d.args else [None]
    out = []
    for b in backends:                            # the valid example answers on every backend
        run(**d.example(), **({{"backend": b}} if b else {{}}))
    for arg, what, kw in d.table():
        for b in backends:
            call = dict(kw, backend=b) if b and arg != 'backend' else kw
            try:
                run(**call)
                res = 'returned'
            except (TypeError, ValueError) as e: res = 'named' if arg in str(e) else 'unnamed: ' + str(e)[:200]
            except Exception as e: res = f'raw {{type(e).__name__}}: {{e}}'[:240]
            out.append((arg, what, b, res))
    print('ROWS' + json.dumps(out))
""")

def run_table(target):
    "Every row of `target`'s table, in a process of its own, must raise an error naming its argument."
    r = subprocess.run([sys.executable, '-c', RUN.format(target=target)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and 'ROWS' in r.stdout, f"{target}: the process ended with {r.returncode}:\n{r.stderr[-3000:]}"
    rows = json.loads(r.stdout.split('ROWS', 1)[1])
    bad = [row for row in rows if row[3] != 'named']
    assert rows and not bad, f"{target}: {len(bad)} of {len(rows)} rows:\n" + '\n'.join(map(str, bad))

# every other table runs from tests/test_declared_more.py: pytest-xdist gives each file to one worker, and the tables,
# a process each, were most of the suite's tail
@pytest.mark.parametrize('target', declared_functions()[0::2])
def test_every_row_of_the_table_raises_an_error_naming_its_argument(target): run_table(target)

def test_the_main_calls_are_declared():
    names = set(declared_functions())
    for want in ['ctc.ctc_loss', 'ctc.forced_align', 'ctc.alignment_entropy', 'ctc.kbest_alignments', 'rnnt.rnnt_loss',
                 'tdt.tdt_loss', 'joint.joint_rnnt_loss', 'crf.CTC_CRF.ctc_loss', 'gru.gru_layer', 'sparse.logZ', 'gru.gru',
                 'cross_entropy.vocab_parallel_cross_entropy']:
        assert want in names

def test_every_public_module_is_declared():
    "Every nn.Module the package exports has a table: as a face of its function, or its forward declared."
    import importlib, torch
    for m in MODULES:
        mod = importlib.import_module(f'seqdist.{m}')
        for n, x in vars(mod).items():
            if isinstance(x, type) and issubclass(x, torch.nn.Module) and x.__module__ == mod.__name__ and not n.startswith('_'):
                assert hasattr(x, 'declaration') or hasattr(x.forward, 'declaration'), f"{m}.{n} has no table"

def test_shapes_with_an_ellipsis_bind_their_named_dimensions():
    import torch
    from seqdist.checks import TensorArg, BoolArg
    dims = {'H': 3}
    TensorArg('... H').check('input', torch.zeros(2, 5, 3), dims)                 # any leading dimensions
    TensorArg('N C ...').check('logits', torch.zeros(2, 7), dims)                 # none after
    assert dims == {'H': 3, 'N': 2, 'C': 7}
    with pytest.raises(ValueError, match=r"input must be of shape \(\.\.\., H\) with H = 3, got shape \(2, 4\)"):
        TensorArg('... H').check('input', torch.zeros(2, 4), dims)
    with pytest.raises(ValueError, match=r"logits must be of shape \(N, C, \.\.\.\)"):
        TensorArg('N C ...').check('logits', torch.zeros(2), {})
    with pytest.raises(TypeError, match="train must be a bool"): BoolArg().check('train', 1, {})

def test_a_declared_call_keeps_its_signature_and_docs():
    import inspect
    assert inspect.signature(ctc.ctc_loss) == inspect.signature(ctc.ctc_loss.__wrapped__)
    assert ctc.ctc_loss.__doc__ == ctc.ctc_loss.__wrapped__.__doc__ and ctc.ctc_loss.__name__ == 'ctc_loss'

def _gather(x, positions, scale=1.0):
    "A function without checks of its own: bad positions are PyTorch's IndexError, a bad scale Python's TypeError."
    return x[positions] * scale

def test_the_declaration_names_the_argument_under_a_raw_error_and_passes_named_errors_through():
    import torch
    from seqdist.checks import declared, TensorArg, RealArg
    f = declared(_gather, lambda: dict(x=torch.randn(4), positions=torch.tensor([0, 2])),
                 x=TensorArg('N'), positions=TensorArg('M', dtype='int'), scale=RealArg())
    assert torch.equal(f(torch.arange(4.), torch.tensor([1, 3])), torch.tensor([1., 3.]))
    with pytest.raises(TypeError, match=r"positions must be an integer tensor, got dtype torch.float32") as e:
        f(torch.randn(4), torch.tensor([0.5]))                      # PyTorch: "tensors used as indices must be long..."
    assert isinstance(e.value.__cause__, IndexError)             # the original, chained
    with pytest.raises(TypeError, match=r"scale must be a real number, got str"):
        f(torch.randn(4), torch.tensor([1]), scale='2')
    with pytest.raises(IndexError):                                # valid as declared: the original error stands
        f(torch.randn(4), torch.tensor([7]))
