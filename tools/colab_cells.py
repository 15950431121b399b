"""Put an "Open in Colab" badge and a Colab install cell at the top of each notebook, or refresh them.

    python tools/colab_cells.py nbs/*.ipynb        # insert or refresh (idempotent)
    python tools/colab_cells.py --check nbs/*.ipynb  # exit 1 naming the notebooks that are not up to date

Both cells come from pyproject.toml, the one place that says where seqdist is installed from: the package name,
[project.urls] Repository (a GitHub repository: seqdist is not on PyPI under its own code) and the CUDA extras
([project.optional-dependencies] cudaNN, which pull in the CuPy built for CUDA NN). The badge goes right after the
title cell; the install cell (`#| hide`: not in the docs) after it. On Colab the cell pip-installs seqdist from the
repository with the extra matching the CUDA of Colab's torch, and makes the `../cuda` folder that the notebooks'
`%%writefile ../cuda/NAME.cu` cells write to (the installed package loads its own copy of the sources); anywhere else
it does nothing. The cells have fixed ids,
so running the script again replaces them in place, and notebooks added later get them by running it again."""
import json, re, sys, tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BADGE_ID, INSTALL_ID = 'colab-badge', 'colab-install'
BADGE_IMG = 'https://colab.research.google.com/assets/colab-badge.svg'

def metadata(pyproject=ROOT / 'pyproject.toml'):
    "(name, GitHub 'owner/repo', branch, {cuda major: extra}) from pyproject.toml."
    cfg = tomllib.loads(Path(pyproject).read_text())
    proj = cfg['project']
    url = proj.get('urls', {}).get('Repository', '')
    m = re.fullmatch(r'https://github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?/?', url)
    if not m: raise SystemExit(f"{pyproject}: [project.urls] Repository must be a https://github.com/OWNER/REPO URL, not {url!r}")
    extras = {re.fullmatch(r'cuda(\d+)', k).group(1): k for k in proj.get('optional-dependencies', {}) if re.fullmatch(r'cuda\d+', k)}
    branch = cfg.get('tool', {}).get('nbdev', {}).get('branch', 'main')
    return proj['name'], m.group(1), branch, dict(sorted(extras.items(), key=lambda kv: int(kv[0])))

def badge_source(nb_path, repo, branch):
    rel = Path(nb_path).resolve().relative_to(ROOT).as_posix()
    return f"[![Open In Colab]({BADGE_IMG})](https://colab.research.google.com/github/{repo}/blob/{branch}/{rel})"

def package_version():
    "The package's version (seqdist/__init__.py, which pyproject.toml reads it from)."
    return re.search(r'__version__ = "([^"]+)"', (ROOT / 'seqdist' / '__init__.py').read_text()).group(1)

def install_source(name, repo, extras):
    major_minor = '.'.join(package_version().split('.')[:2]) + '.'

    return f'''#| hide
# On Colab: install {name} from its repository, with CuPy for the CUDA of Colab's torch. Elsewhere: nothing.
# (Written by tools/colab_cells.py from pyproject.toml: edit those, not this cell.)
import sys
if 'google.colab' in sys.modules:
    import subprocess, torch
    cuda = (torch.version.cuda or '').split('.')[0]     # '' on a CPU runtime
    extra = {extras!r}.get(cuda)
    if cuda and not extra: print(f"no CuPy extra for CUDA {{cuda}}: installing {name} without it (CPU and emulator only)")
    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', f"{name}{{'[' + extra + ']' if extra else ''}} @ git+https://github.com/{repo}"], check=True)
    from importlib.metadata import version
    if not version({name!r}).startswith({major_minor!r}):    # e.g. the repository holding another {name}
        raise RuntimeError(f"installed {name} {{version({name!r})}}, but these notebooks are {name} {major_minor}x: "
                           "set [project.urls] Repository in pyproject.toml to where this version lives")
    import os; os.makedirs('../cuda', exist_ok=True)     # where the %%writefile cells write their CUDA sources'''

def cell(cell_id, cell_type, source):
    c = {'cell_type': cell_type, 'id': cell_id, 'metadata': {}, 'source': source.splitlines(keepends=True)}
    if cell_type == 'code': c.update(execution_count=None, outputs=[])
    return {k: c[k] for k in sorted(c)}        # keys in the order nbdev-clean writes them

def refreshed(nb, nb_path, meta):
    "The notebook with its badge and install cell (re)placed right after its first cell."
    name, repo, branch, extras = meta
    cells = [c for c in nb['cells'] if c.get('id') not in (BADGE_ID, INSTALL_ID)]
    new = [cell(BADGE_ID, 'markdown', badge_source(nb_path, repo, branch)), cell(INSTALL_ID, 'code', install_source(name, repo, extras))]
    return dict(nb, cells=cells[:1] + new + cells[1:])

def dumps(nb): return json.dumps(nb, indent=1, ensure_ascii=False) + '\n'

def main(args):
    check = '--check' in args
    paths = [Path(a) for a in args if a != '--check']
    meta, stale = metadata(), []
    for p in paths:
        text = p.read_text()
        new = dumps(refreshed(json.loads(text), p, meta))
        if new == text: continue
        if check: stale.append(str(p))
        else: p.write_text(new); print(f"{p}: Colab badge and install cell written")
    if stale: sys.exit("not up to date (run `make colab-cells`): " + ', '.join(stale))

if __name__ == '__main__':
    main(sys.argv[1:])
