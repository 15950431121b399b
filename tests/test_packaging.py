"""An installed (non-editable) wheel carries the CUDA sources and runs a kernel from them."""
import importlib.util, os, pathlib, subprocess, sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

def wheel_command(out):
    """pip's wheel build; without build isolation when the build backend is already installed, so that a machine
    with no network (a GPU box) can build too: an isolated build would fetch setuptools from an index."""
    isolation = [] if importlib.util.find_spec('setuptools') is None else ['--no-build-isolation']
    return [sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', *isolation, str(ROOT), '-w', str(out)]

def test_wheel_ships_cuda_sources_and_runs_a_kernel(tmp_path):
    # No package index, as on a machine without network: the build must not need to download anything.
    env = {**os.environ, 'PIP_NO_INDEX': '1', 'PIP_FIND_LINKS': ''}
    r = subprocess.run(wheel_command(tmp_path / 'wheel'), capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next((tmp_path / 'wheel').glob('seqdist-*.whl'))
    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps', '--target', str(tmp_path / 'site'), str(wheel)],
                   check=True, capture_output=True)
    code = ("import seqdist, torch; from seqdist.utils import cuda_dir, semiring_sum\n"
            "assert seqdist.__file__.startswith({site!r}), seqdist.__file__\n"
            "assert cuda_dir() == __import__('pathlib').Path({site!r}) / 'seqdist' / 'cuda', cuda_dir()\n"
            "x = torch.randn(3, 50, dtype=torch.float64)\n"
            "assert torch.allclose(semiring_sum(x), torch.logsumexp(x, 1))\n").format(site=str(tmp_path / 'site'))
    env = {**os.environ, 'PYTHONPATH': str(tmp_path / 'site'), 'SEQDIST_CACHE': str(tmp_path / 'cache')}
    r = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
