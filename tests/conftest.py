import os, pathlib, pytest, torch

KERNELS = pathlib.Path(__file__).parent / 'kernels'

@pytest.fixture(autouse=True)
def _threads_and_seed():
    torch.set_num_threads(2)
    torch.manual_seed(0)

from hypothesis import settings
settings.register_profile('seqdist', derandomize=True, deadline=None)  # the same examples on every CI run
settings.load_profile('seqdist')

def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        for item in items:
            if 'gpu' in item.keywords: item.add_marker(pytest.mark.skip(reason="needs a CUDA device (make gpu-check)"))
    _torchaudio(items)

def _torchaudio(items):
    """Tests marked `torchaudio` compare with torchaudio: they are skipped, visibly, where it cannot be loaded, except
    under `make test` (SEQDIST_REQUIRE_TORCHAUDIO=1), which installs it and where its absence is a failure."""
    if not any('torchaudio' in item.keywords for item in items): return
    from seqdist.bench import load_torchaudio
    if load_torchaudio() is not None: return
    if os.environ.get('SEQDIST_REQUIRE_TORCHAUDIO') == '1':
        raise pytest.UsageError("torchaudio does not load, but SEQDIST_REQUIRE_TORCHAUDIO=1: run `make install`")
    skip = pytest.mark.skip(reason="torchaudio is not installed (make install puts it in the venv)")
    for item in items:
        if 'torchaudio' in item.keywords: item.add_marker(skip)
