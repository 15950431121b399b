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

def test_host_cost_counts_what_a_cuda_call_costs_the_host(tmp_path):
    """tools/host_cost.py (the CUDA path's host cost without a GPU): each call's PyTorch ops, the launching ones and
    seqdist's launches, counted with inputs treated as a GPU's; ctc_loss at the budget tests/test_launches.py holds."""
    out = tmp_path / 'host.json'
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'host_cost.py'), '--rounds', '1', '--calls', '1', '--json', str(out)],
                       capture_output=True, text=True, cwd=ROOT, env={**__import__('os').environ, 'PYTHONPATH': str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row['call']: row for row in json.loads(out.read_text())['rows']}
    assert len(rows) == 7 and all(row['ops'] >= row['launching_ops'] > 0 and row['host_us'] > 0 for row in rows.values())
    ctc = rows['ctc_loss (log_softmax, mean)']
    assert ctc['kernels'] == {'ctc_prepare': 1, 'ctc_alpha_beta': 1, 'ctc_posteriors': 1, 'ctc_grad': 1}
    assert ctc['launching_ops'] <= 17, ctc
    joint = rows['joint_rnnt_loss (8 tiles)']                    # a tile: two activations, stats, grad, backprop
    assert {k: joint['kernels'][k] for k in ('joint_tile_act', 'joint_tile_stats', 'joint_tile_grad', 'joint_tile_backprop')} \
        == {'joint_tile_act': 16, 'joint_tile_stats': 8, 'joint_tile_grad': 8, 'joint_tile_backprop': 8}, joint
