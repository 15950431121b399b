"""Run the code cells of notebooks top to bottom, as `nbdev-test` does, on a machine without nbdev or Jupyter (the GPU
boxes): `python tools/run_notebook.py [--flags cuda] nbs/*.ipynb`. Each notebook runs in a fresh process with nbs/ as
its working directory; `%%writefile [-a] PATH` cells write their text as IPython would; cells flagged with a test flag
(`#| cuda`, `#| notest`) run only if the flag is given. Exits non-zero, naming the notebook and cell, on a failure."""
import argparse, json, os, re, subprocess, sys, time
from pathlib import Path

def cell_flags(source):
    return {m.group(1) for m in re.finditer(r'^#\|\s*(\w+)\s*$', source, re.M)}

def notebook_program(path, flags):
    "The notebook's code cells as one Python program (a function call per cell, so a failure names the cell)."
    cells = json.loads(Path(path).read_text())['cells']
    out = ["import sys, traceback", "def _writefile(name, text, append):",
           "    with open(name, 'a' if append else 'w') as f: f.write(text)"]
    for i, c in enumerate(cells):
        if c['cell_type'] != 'code': continue
        src = ''.join(c['source'])
        skip = ({'cuda', 'notest'} & cell_flags(src)) - set(flags)
        if skip: continue
        m = re.match(r'%%writefile(\s+-a)?\s+(\S+)\n', src)
        if m: src = f"_writefile({m.group(2)!r}, {src[m.end():].rstrip(chr(10)) + chr(10)!r}, {bool(m.group(1))})"   # as IPython: one final newline
        if re.search(r'^\s*[%!]', src, re.M): raise SystemExit(f"{path}: cell {i} uses IPython syntax this runner does not know")
        out.append(f"print('-- cell {i}', flush=True)")
        out.append(f"exec(compile({src!r}, '{Path(path).name}, cell {i}', 'exec'), globals())")
    return '\n'.join(out)

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--flags', default='', help="space-separated test flags whose cells also run, e.g. 'cuda'")
    p.add_argument('notebooks', nargs='+')
    a = p.parse_args()
    root, failed = Path(__file__).resolve().parent.parent, []
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(root), os.environ.get('PYTHONPATH', '')]).rstrip(os.pathsep)}
    for nb in a.notebooks:
        nb = Path(nb).resolve()
        if nb.name.startswith(('_', 'index')): continue
        start = time.time()
        r = subprocess.run([sys.executable, '-c', notebook_program(nb, a.flags.split())], cwd=nb.parent, env=env,
                           capture_output=True, text=True)
        status = 'ok' if r.returncode == 0 else 'FAILED'
        print(f"{nb.name}: {status} ({time.time() - start:.0f} s)", flush=True)
        if r.returncode:
            failed.append(nb.name)
            print(r.stdout[-3000:], r.stderr[-5000:], sep='\n')
    if failed: raise SystemExit(f"failed: {', '.join(failed)}")

if __name__ == '__main__': main()
