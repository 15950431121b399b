import contextlib, importlib.util, os, pathlib, pytest, torch

KERNELS = pathlib.Path(__file__).parent / 'kernels'

@pytest.fixture(autouse=True)
def _threads_and_seed():
    torch.set_num_threads(2)
    torch.manual_seed(0)

_overruns = []   # Kernel.__call__ as it was, then the lists of the active `budget_overruns` blocks (the innermost last)

@contextlib.contextmanager
def budget_overruns():
    """Yields the list of the launches made within it of a kernel with a resource budget (`resource_budget`, next to
    the kernels in their notebook) that exceed its declared block or dynamic shared memory."""
    from seqdist.kernel import Kernel, _dims
    from seqdist.compile_check import _short_macros
    if not _overruns:
        launch = Kernel.__call__
        def checked(self, grid, block, args=None, *, shared_mem=0, **named):
            out = launch(self, grid, block, args, shared_mem=shared_mem, **named)
            b = getattr(self, 'budget', None)
            if b is not None and len(_overruns) > 1:
                bx, by, bz = _dims(block, 'block', self.name)
                if bx * by * bz > b.block or shared_mem > b.shared_mem:
                    _overruns[-1].append(f"{self.name} ({self.path.name} {_short_macros(self)}) launched with block={block}, "
                                         f"shared_mem={shared_mem}: its budget declares block {b.block}, {b.shared_mem} bytes")
            return out
        _overruns.append(launch)          # the bottom of the stack: the launch to restore
        Kernel.__call__ = checked
    _overruns.append([])
    try: yield _overruns[-1]
    finally:
        _overruns.pop()
        if len(_overruns) == 1: Kernel.__call__ = _overruns.pop()

@pytest.fixture(autouse=True)
def _launches_within_budget():
    "Every launch a test makes stays within its kernel's budget: `seqdist-compile-check`'s occupancy is that of real launches."
    with budget_overruns() as over: yield
    assert not over, "launches beyond their kernel's declared resource budget:\n" + "\n".join(dict.fromkeys(over))

from hypothesis import settings
settings.register_profile('seqdist', derandomize=True, deadline=None)  # the same examples on every CI run
settings.load_profile('seqdist')

def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        for item in items:
            if 'gpu' in item.keywords: item.add_marker(pytest.mark.skip(reason="needs a CUDA device (make gpu-check)"))
    _optional(items, 'torchaudio', 'SEQDIST_REQUIRE_TORCHAUDIO', _torchaudio_loads)
    _optional(items, 'kenlm', 'SEQDIST_REQUIRE_KENLM', lambda: importlib.util.find_spec('kenlm') is not None)
    _optional(items, 'pyctcdecode', 'SEQDIST_REQUIRE_PYCTCDECODE', lambda: importlib.util.find_spec('pyctcdecode') is not None)

def _torchaudio_loads():
    from seqdist.timing import load_torchaudio
    return load_torchaudio() is not None

def _optional(items, marker, required_by, loads):
    """Tests marked `marker` compare with an optional package (torchaudio, kenlm, pyctcdecode): they are skipped, visibly, where it
    cannot be loaded, except under `make test` (`required_by`=1), which installs it and where its absence is a failure."""
    if not any(marker in item.keywords for item in items) or loads(): return
    if os.environ.get(required_by) == '1':
        raise pytest.UsageError(f"{marker} does not load, but {required_by}=1: run `make install`")
    skip = pytest.mark.skip(reason=f"{marker} is not installed (make install puts it in the venv)")
    for item in items:
        if marker in item.keywords: item.add_marker(skip)

# `make gpu-check`'s summary: per family, the GPU tests' outcomes, the kernels they launched and the worst error
# against the CPU (from the user properties that tests/test_gpu.py records).
_gpu_results = {}

def pytest_runtest_logreport(report):
    if 'test_gpu.py' not in report.nodeid or '[' not in report.nodeid: return
    if report.when != 'call' and not (report.skipped or report.failed): return
    props = dict(report.user_properties)
    name, params = report.nodeid.split('::')[-1].split('[', 1)
    family = props.get('family') or (params.rstrip(']').split('-')[0] if name.startswith('test_gpu_') else 'other')
    r = _gpu_results.setdefault(family, dict(passed=0, failed=0, skipped=0, kernels=set(), error=0.0))
    r['failed' if report.failed else 'skipped' if report.skipped else 'passed'] += 1
    r['kernels'].update(props.get('kernels', ()))
    r['error'] = max(r['error'], props.get('error') or 0.0)

def pytest_terminal_summary(terminalreporter, config):
    "Printed under `-m gpu` (make gpu-check), and written to $SEQDIST_GPU_SUMMARY for the Makefile to show at the end."
    if not _gpu_results or 'gpu' not in (config.getoption('markexpr') or ''): return
    lines = [f"{'family':22} {'passed':>6} {'failed':>6} {'skipped':>7} {'worst err':>9}  kernels"]
    for fam, r in sorted(_gpu_results.items()):
        lines.append(f"{fam:22} {r['passed']:>6} {r['failed']:>6} {r['skipped']:>7} {r['error']:>9.1e}  {' '.join(sorted(r['kernels'])) or '-'}")
    terminalreporter.section("GPU tests by family (worst err: largest absolute difference from the CPU in float64)")
    for line in lines: terminalreporter.line(line)
    if os.environ.get('SEQDIST_GPU_SUMMARY'): pathlib.Path(os.environ['SEQDIST_GPU_SUMMARY']).write_text('\n'.join(lines) + '\n')


def small_emformer_rnnt(seed=0):
    "A small torchaudio Emformer RNN-T (10 symbols, the blank 9), in eval mode: the transducer decoders' tests take it as it is."
    from seqdist.timing import load_torchaudio
    load_torchaudio()
    from torchaudio.models import emformer_rnnt_model
    torch.manual_seed(seed)
    return emformer_rnnt_model(input_dim=20, encoding_dim=16, num_symbols=10, segment_length=4, right_context_length=0,
        time_reduction_input_dim=16, time_reduction_stride=1, transformer_num_heads=2, transformer_ffn_dim=16,
        transformer_num_layers=1, transformer_dropout=0.0, transformer_activation='relu', transformer_left_context_length=8,
        transformer_max_memory_size=0, transformer_weight_init_scale_strategy=None, transformer_tanh_on_mem=False,
        symbol_embedding_dim=8, num_lstm_layers=2, lstm_layer_norm=True, lstm_layer_norm_epsilon=1e-5, lstm_dropout=0.0).eval()

def word_option_searches(semiring, merge=lambda seed: False, seeds=60):
    """(seed, arguments of the beam search's backends) over small random batches, the word options in turn: an LM or
    none, hotwords, a lexicon, the partial-word score, whole words, the lookahead, and `merge(seed)` delimiters merged."""
    import math
    from seqdist.decode import PrefixScorer, NGramLM, Hotwords, random_arpa
    tokens5, words5 = ['-', 'a', 'b', '|', '▁c'], ['a', 'b', 'ab', 'ba', 'c', 'ca', 'cab', 'bab']
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        N, T, C = 3, 4 + seed % 11, (5, 24)[seed % 2]
        toks = tokens5 if C == 5 else ['-', '|'] + [f'{a}{b}' for a in 'abcd' for b in ('', 'a', 'b', 'ab', 'ba', 'ca')][:C - 2]
        lp = torch.randn(N, T, C, generator=g, dtype=torch.float64).mul(1 + seed % 3).log_softmax(-1)
        scorer = PrefixScorer(C, 0, toks, NGramLM(text=random_arpa(seed, words5, order=2)) if seed % 5 else None, 0.7, -0.2,
                              Hotwords([[1, 2], [2, 3, 1], [3]], [0.5, 1.0, -0.2], C) if seed % 3 else None,
                              ['a', 'ab', 'aab', 'b', 'ba', 'c', 'cab', 'ca'] if seed % 4 == 1 else None, unk_score=-1.0,
                              unk_prefix_score=(0.0, -2.0)[seed % 7 < 3], whole_words=seed % 2 == 0, lookahead=seed % 3 == 0)
        yield seed, (lp, torch.randint(0, T + 1, (N,), generator=g), 1 + seed % 6, 0, 1 + (semiring == 'log') * (seed % 2),
                     scorer, (math.inf, 2.0)[seed % 2], merge(seed), semiring)
