"""Move cells of one notebook into a new notebook that continues the same module (a one-off layout tool).

    python tools/split_notebook.py SPEC.json

SPEC: {"source": "nbs/02_ctc.ipynb", "module": "ctc", "parts": [{"name": "nbs/02a_ctc_align.ipynb",
"title": "# ...", "blurb": "> ...", "cells": [36, 37, ...]}]}. The moved cells leave the source notebook; in the new
one, `#| export` becomes `#| export MODULE` (nbdev 3 appends those cells to the module the source notebook makes,
which `nbdev-export` writes first, as it exports notebooks in name order), and a hidden cell imports what the moved
cells use from the module and from the source notebook's imports. Names the moved cells use that only the source
notebook's other cells define are printed: those need a cell of their own in the new notebook."""
import ast, builtins, importlib, importlib.util, json, re, sys, types
from pathlib import Path

def src(c): return ''.join(c['source'])

def code_of(s):
    "A cell's Python, magics and directives dropped."
    if s.startswith('%%'): return ''
    return '\n'.join(l for l in s.splitlines() if not l.lstrip().startswith(('%', '!')))

def names(s):
    "(defined, used) names of a cell's code."
    try: tree = ast.parse(code_of(s))
    except SyntaxError: return set(), set()
    defined, used = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)): defined.add(n.name)
        elif isinstance(n, ast.Name): (defined if isinstance(n.ctx, ast.Store) else used).add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names: defined.add((a.asname or a.name).split('.')[0])
        elif isinstance(n, ast.arg): defined.add(n.arg)
    return defined, used

def import_lines(s):
    "The import statements at a cell's top level."
    try: tree = ast.parse(code_of(s))
    except SyntaxError: return []
    return [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]

def cell(kind, text, **kw):
    c = {'cell_type': kind, 'metadata': {}, 'source': text.splitlines(keepends=True)}
    if kind == 'code': c.update(execution_count=None, outputs=[])
    c.update(kw)
    return c

def split(spec):
    source = Path(spec['source'])
    nb, module_name = json.loads(source.read_text()), spec['module']
    moved_all = set()
    for part in spec['parts']:
        idx = part['cells']
        moved_all |= set(idx)
        cells = [json.loads(json.dumps(nb['cells'][i])) for i in idx]
        for c in cells:
            if c['cell_type'] == 'code':
                s = src(c)
                s = re.sub(r'^#\|\s*(export|exporti)\s*$', rf"#| \1 {module_name}", s, flags=re.M)
                c['source'] = s.splitlines(keepends=True)
        lines, missing = import_cell(cells, [nb], module_name)
        new = [cell('markdown', part['title'] + '\n\n' + part['blurb']), cell('code', '\n'.join(lines))]
        new += cells
        out = {k: v for k, v in nb.items() if k != 'cells'}
        out['cells'] = new
        Path(part['name']).write_text(json.dumps(out, indent=1, ensure_ascii=False) + '\n')
        print(part['name'], sum(len(src(c).splitlines()) for c in new), 'lines; needs a cell for:', missing)
    nb['cells'] = [c for i, c in enumerate(nb['cells']) if i not in moved_all]
    source.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
    print(source, sum(len(src(c).splitlines()) for c in nb['cells']), 'lines left')

def import_cell(cells, sources, module_name):
    "The hidden cell's lines: what `cells` use and do not define, from `sources`' imports and from the module."
    module = importlib.import_module(f"seqdist.{module_name}")
    defined, used = set(), set()
    for c in cells:
        if c['cell_type'] != 'code' or src(c).startswith('#| hide\n# what this notebook takes'): continue
        if '# On Colab: install seqdist' in src(c): continue      # (it imports torch on Colab only)
        d, u = names(src(c)); used |= u - d - defined; defined |= d
    need = sorted(used - set(dir(builtins)))      # used before (or without) a cell of this notebook defines them
    if True:
        # imports the source notebook's cells make (kept verbatim when they bring a needed name)
        imports, from_module, missing = [], [], []
        for c in [c for nb in sources for c in nb['cells']]:
            if c['cell_type'] != 'code': continue
            for line in import_lines(src(c)):
                d, _ = names(line)
                have = set().union(*[names(l)[0] for l in imports]) if imports else set()
                if not (d & set(need)) - have or line.startswith(f"from seqdist.{module_name} import"): continue
                top = line.split()[1].split('.')[0].rstrip(',')
                if importlib.util.find_spec(top) is None: continue      # e.g. `koi`, which a cell installs first
                imports.append(line)
        covered = set().union(*[names(l)[0] for l in imports]) if imports else set()
        for n in need:
            if n in covered: continue
            v = getattr(module, n, None)
            if isinstance(v, types.ModuleType): imports.append(f"import {v.__name__}" + (f" as {n}" if v.__name__ != n else ''))
            elif hasattr(module, n): from_module.append(n)
            else: missing.append(n)
        lines = ['#| hide', f"# what this notebook takes from the ones before it (seqdist.{module_name} is made by them and this one)"]
        lines += imports
        if from_module:
            line, out = f"from seqdist.{module_name} import ", []
            for n in from_module:
                if len(line) + len(n) > 116: out.append(line.rstrip(', ') + ','); line = '    '
                line += n + ', '
            out.append(line.rstrip(', '))
            lines.append(out[0].replace('import ', 'import (', 1) + ('\n' + '\n'.join(out[1:]) + ')' if len(out) > 1 else ')'))
        return lines, missing

def move(a, idx, b, at, module_name):
    "Move cells `idx` of notebook a to position `at` of notebook b (a continuation of module_name), and redo b's import cell."
    na, nb = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    cells = [na['cells'][i] for i in idx]
    for c in cells:
        if c['cell_type'] == 'code':
            c['source'] = re.sub(r'^#\|\s*(export|exporti)\s*$', rf"#| \1 {module_name}", src(c), flags=re.M).splitlines(keepends=True)
    na['cells'] = [c for i, c in enumerate(na['cells']) if i not in idx]
    nb['cells'][at:at] = cells
    lines, missing = import_cell(nb['cells'], [na, nb], module_name)
    k = next(i for i, c in enumerate(nb['cells']) if src(c).startswith('#| hide\n# what this notebook takes'))
    nb['cells'][k]['source'] = '\n'.join(lines).splitlines(keepends=True)
    for p, n in ((a, na), (b, nb)): Path(p).write_text(json.dumps(n, indent=1, ensure_ascii=False) + '\n')
    print(a, sum(len(src(c).splitlines()) for c in na['cells']), b, sum(len(src(c).splitlines()) for c in nb['cells']), 'needs:', missing)

if __name__ == '__main__':
    if sys.argv[1] == 'move': move(sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6])
    else: split(json.loads(Path(sys.argv[1]).read_text()))
