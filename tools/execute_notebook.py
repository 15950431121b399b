"""Run notebooks top to bottom and save them with their outputs, which GitHub, Colab and the docs site show:
`python tools/execute_notebook.py nbs/02_ctc.ipynb [...]`, then `nbdev-clean`. Cells flagged `cuda` (they need a GPU)
and `notest` are not run and keep no output. Run it in the notebook's venv (`.venv/bin/python`) on a quiet machine:
the benchmark cells print what they measure."""
import os, re, sys, time
from pathlib import Path
from fastcore.nbio import read_nb, write_nb
from execnb.shell import CaptureShell

def flags(source): return {m.group(1) for m in re.finditer(r'^#\|\s*(\w+)\s*$', source, re.M)}

def skipped(cell):
    "Not run here: cells that need a GPU, and cells nbdev-test skips. Their old outputs go."
    if cell.cell_type == 'code' and flags(cell.source) & {'cuda', 'notest'}:
        cell.outputs = []
        return True
    return False

def execute(path):
    path = Path(path).resolve()
    nb = read_nb(path)
    cwd = os.getcwd()
    os.chdir(path.parent)                 # as nbdev-test: relative paths (%%writefile ../cuda/...) from nbs/
    try:
        start = time.time()
        CaptureShell(path=path.parent).run_all(nb, exc_stop=True, preproc=skipped)
    finally: os.chdir(cwd)
    write_nb(nb, path)
    print(f"{path.name}: {time.time() - start:.0f} s", flush=True)

if __name__ == '__main__':
    for p in sys.argv[1:]: execute(p)
