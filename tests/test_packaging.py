"""An installed (non-editable) wheel carries the CUDA sources and runs a kernel from them."""
import os, pathlib, subprocess, sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

def test_wheel_ships_cuda_sources_and_runs_a_kernel(tmp_path):
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', str(ROOT), '-w', str(tmp_path / 'wheel')],
                   check=True, capture_output=True)
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
