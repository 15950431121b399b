"""Every name the README and the notebooks show a reader imports from where they show it: the `from seqdist.X import
a, b` lines of the README's code and of the notebooks' prose and cells, and the dotted `seqdist.x.y` names in their
prose. The notebooks were split into one job each (02_ctc into 02_ctc, 02a_ctc_align, ...); a family's later
notebooks add to the module its first one makes, so a name moves between notebooks, never between import paths."""
import importlib, json, re
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
IMPORT = re.compile(r'from\s+(seqdist(?:\.\w+)*)\s+import\s+(\([^)]*\)|[\w ,*]+(?:\\\n[\w ,]+)*)')
DOTTED = re.compile(r'`(seqdist(?:\.\w+)+)')

def texts():
    "(where, text, is_prose) for the README and each notebook cell."
    yield 'README.md', (ROOT / 'README.md').read_text(), True
    for nb in sorted((ROOT / 'nbs').glob('*.ipynb')):
        for i, cell in enumerate(json.loads(nb.read_text())['cells']):
            yield f'{nb.name} cell {i}', ''.join(cell['source']), cell['cell_type'] == 'markdown'

def shown_imports():
    "{(module, name): first place shown} over every `from seqdist... import ...` line a reader sees."
    out = {}
    for where, text, _ in texts():
        for m in IMPORT.finditer(text):
            names = re.sub(r'#[^\n]*', '', m.group(2).strip('()').replace('\\\n', ' '))
            for item in names.split(','):
                name = (item.split() or [''])[0]                # `a as b` imports a
                if re.fullmatch(r'\w+', name) and not name.startswith('_'): out.setdefault((m.group(1), name), where)
    return out

def shown_dotted():
    "{dotted name: first place shown} over the `seqdist.x.y` names of the README and the notebooks' prose."
    out = {}
    for where, text, prose in texts():
        if prose:
            for m in DOTTED.finditer(text): out.setdefault(m.group(1).rstrip('.'), where)
    return out

IMPORTS, DOTTED_NAMES = shown_imports(), shown_dotted()

def test_the_readers_names_were_found():
    "The scan finds the README's first look and the families' switches (a broken pattern would find nothing)."
    for shown in [('seqdist.ctc', 'ctc_loss'), ('seqdist.ctc', 'forced_align'), ('seqdist.rnnt', 'rnnt_loss'),
                  ('seqdist.tdt', 'tdt_loss'), ('seqdist.gru', 'GRU'), ('seqdist.cross_entropy', 'linear_cross_entropy')]:
        assert shown in IMPORTS, shown
    assert 'seqdist.koi' in DOTTED_NAMES and len(IMPORTS) > 50

@pytest.mark.parametrize('module, name', sorted(IMPORTS), ids=[f'{m}.{n}' for m, n in sorted(IMPORTS)])
def test_a_shown_import_works(module, name):
    m = importlib.import_module(module)
    if hasattr(m, name): return
    importlib.import_module(f'{module}.{name}')        # `from seqdist import ctc`: a module

@pytest.mark.parametrize('dotted', sorted(DOTTED_NAMES))
def test_a_shown_dotted_name_resolves(dotted):
    parts = dotted.split('.')
    for k in range(len(parts), 0, -1):                 # the longest importable prefix, then attributes
        try: obj = importlib.import_module('.'.join(parts[:k])); break
        except ImportError: continue
    for attr in parts[k:]:
        assert hasattr(obj, attr), f"{dotted} (shown in {DOTTED_NAMES[dotted]}): {'.'.join(parts[:k])} has no {attr}"
        obj = getattr(obj, attr)
