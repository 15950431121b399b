"""tools/run_notebook.py, the notebook runner of `make gpu-check` (GPU boxes have no nbdev): cells in order, %%writefile
as IPython, flagged cells only with their flag, a failure named."""
import json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def notebook(path, cells):
    nb = {'cells': [{'cell_type': 'code', 'metadata': {}, 'source': s, 'outputs': [], 'execution_count': None} for s in cells],
          'metadata': {}, 'nbformat': 4, 'nbformat_minor': 5}
    path.write_text(json.dumps(nb))
    return path

def run(*args):
    return subprocess.run([sys.executable, str(ROOT / 'tools' / 'run_notebook.py'), *map(str, args)], capture_output=True, text=True)

def test_cells_run_in_order_and_writefile_and_flags(tmp_path):
    nb = notebook(tmp_path / 'a.ipynb', ["%%writefile out.txt\nline one", "%%writefile -a out.txt\nline two",
                                         "x = open('out.txt').read()", "#| cuda\nopen('cuda_ran', 'w')",
                                         "assert x == 'line one\\nline two\\n', repr(x)"])
    r = run(nb)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (tmp_path / 'cuda_ran').exists()
    assert run('--flags', 'cuda', nb).returncode == 0 and (tmp_path / 'cuda_ran').exists()

def test_a_failing_cell_is_named(tmp_path):
    r = run(notebook(tmp_path / 'b.ipynb', ["y = 1", "raise ValueError('boom')"]))
    assert r.returncode != 0 and 'b.ipynb, cell 1' in r.stdout + r.stderr and 'boom' in r.stdout + r.stderr

def test_gpu_bench_script_parses_its_arguments():
    "tools/gpu_bench.py (`make gpu-bench-quick`), the one script a GPU slot runs: it imports and takes its arguments."
    import subprocess, sys
    r = subprocess.run([sys.executable, 'tools/gpu_bench.py', '--help'], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0 and '--seconds' in r.stdout, r.stderr
