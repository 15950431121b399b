"""The docs tooling: tools/colab_cells.py (the Colab badge and install cell, and what that cell does on Colab and
elsewhere), tools/docs.py (page names and reading order, links, the page template: no prompts, API entries, long
outputs folded, nothing fetched from the network) and tools/site/check.mjs (the headless-Chromium check catches what
it is meant to catch). No notebook is executed here."""
import importlib.util, json, os, re, shutil, subprocess, sys, types
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent

def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / 'tools' / f'{name}.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

colab, docs = load('colab_cells'), load('docs')

# --- Colab cells ---------------------------------------------------------------------------------------------------

def test_metadata_comes_from_pyproject(tmp_path):
    name, repo, branch, extras = colab.metadata()
    assert name == 'seqdist' and re.fullmatch(r'[\w.-]+/[\w.-]+', repo) and branch == 'main'
    assert extras == {'12': 'cuda12', '13': 'cuda13'}
    bad = tmp_path / 'pyproject.toml'
    bad.write_text('[project]\nname = "x"\n[project.urls]\nRepository = "https://example.org/x"\n')
    with pytest.raises(SystemExit, match='Repository'): colab.metadata(bad)

def run_install_cell(monkeypatch, tmp_path, on_colab, cuda):
    "Execute the generated install cell with Colab faked (or not) and torch's CUDA version set; return pip's argv."
    calls = []
    monkeypatch.setattr(subprocess, 'run', lambda args, **kw: calls.append((args, kw)))
    import torch
    monkeypatch.setattr(torch.version, 'cuda', cuda)
    if on_colab: monkeypatch.setitem(sys.modules, 'google.colab', types.ModuleType('google.colab'))
    else: monkeypatch.delitem(sys.modules, 'google.colab', raising=False)
    (tmp_path / 'nbs').mkdir(); monkeypatch.chdir(tmp_path / 'nbs')
    name, repo, branch, extras = colab.metadata()
    exec(compile(colab.install_source(name, repo, extras), 'install-cell', 'exec'), {})
    return calls, repo

@pytest.mark.parametrize('cuda, extra', [('12.4', '[cuda12]'), ('12.8', '[cuda12]'), ('13.0', '[cuda13]'), (None, ''), ('11.8', '')])
def test_install_cell_on_colab_installs_the_extra_of_torchs_cuda(monkeypatch, tmp_path, capsys, cuda, extra):
    calls, repo = run_install_cell(monkeypatch, tmp_path, True, cuda)
    assert len(calls) == 1
    args, kw = calls[0]
    assert args[:4] == [sys.executable, '-m', 'pip', 'install'] and kw == {'check': True}
    assert args[-1] == f'seqdist{extra} @ git+https://github.com/{repo}'
    assert (tmp_path / 'cuda').is_dir()                      # the %%writefile ../cuda/NAME.cu cells can write
    assert ('no CuPy extra for CUDA 11' in capsys.readouterr().out) == (cuda == '11.8')

def test_install_cell_does_nothing_off_colab(monkeypatch, tmp_path):
    calls, _ = run_install_cell(monkeypatch, tmp_path, False, '12.4')
    assert calls == [] and not (tmp_path / 'cuda').exists()

def test_every_notebook_has_current_colab_cells():
    "Every notebook starts with its title, the badge for its own path, then the hidden install cell, as the script writes them."
    nbs = sorted((ROOT / 'nbs').glob('*.ipynb'))
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'colab_cells.py'), '--check', *map(str, nbs)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in nbs:
        cells = json.loads(p.read_text())['cells']
        assert cells[0]['cell_type'] == 'markdown' and ''.join(cells[0]['source']).startswith('# ')
        assert [c['id'] for c in cells[1:3]] == ['colab-badge', 'colab-install']
        assert f"/blob/main/nbs/{p.name})" in ''.join(cells[1]['source'])
        assert ''.join(cells[2]['source']).startswith('#| hide\n')

def test_script_inserts_refreshes_and_is_idempotent(tmp_path):
    meta = colab.metadata()
    nb = {'cells': [{'cell_type': 'markdown', 'id': 't', 'metadata': {}, 'source': ['# x: y']},
                    {'cell_type': 'code', 'id': 'c', 'metadata': {}, 'source': ['1'], 'outputs': [], 'execution_count': None},
                    {'cell_type': 'markdown', 'id': 'colab-badge', 'metadata': {}, 'source': ['stale, misplaced']}],
          'metadata': {}, 'nbformat': 4, 'nbformat_minor': 5}
    p = ROOT / 'nbs' / '99_new.ipynb'                    # a path under nbs/ (only its name is used, nothing is written)
    once = colab.refreshed(nb, p, meta)
    assert [c['id'] for c in once['cells']] == ['t', 'colab-badge', 'colab-install', 'c']
    assert 'stale' not in json.dumps(once) and 'nbs/99_new.ipynb' in ''.join(once['cells'][1]['source'])
    assert colab.refreshed(once, p, meta) == once

# --- the site ------------------------------------------------------------------------------------------------------

def test_pages_in_reading_order_named_as_quarto_names_them(tmp_path):
    for n in ['10_bench', '02_ctc', 'index', '06_rnnt', '00_core', 'scratch']: (tmp_path / f'{n}.ipynb').write_text('{}')
    assert [p.name for p in docs.notebooks(tmp_path)] == ['index.ipynb', '00_core.ipynb', '02_ctc.ipynb', '06_rnnt.ipynb', '10_bench.ipynb']
    assert [docs.page_name(n) for n in ['02_ctc.ipynb', '08_cross_entropy.ipynb', 'index.ipynb']] == ['ctc.html', 'cross_entropy.html', 'index.html']
    assert docs.title_of(ROOT / 'nbs' / '02_ctc.ipynb')[0] == '02 ctc'

@pytest.mark.parametrize('href, site, readme', [
    ('/ctc.html#ctc_loss', 'ctc.html#ctc_loss', 'nbs/02_ctc.ipynb'),       # nbdev's doc links (README/index, show_doc)
    ('/crf.html#CTC_CRF', 'crf.html#ctc_crf', 'nbs/05_crf.ipynb'),
    ('02_ctc.ipynb', 'ctc.html', 'nbs/02_ctc.ipynb'),                       # notebook-to-notebook links
    ('../nbs/04_sparse.ipynb#Backward', 'sparse.html#backward', '../nbs/04_sparse.ipynb#Backward'),
    ('images/ctc_speed.png', 'images/ctc_speed.png', 'nbs/images/ctc_speed.png'),     # figures next to the notebooks
    ('https://nbdev.fast.ai', 'https://nbdev.fast.ai', 'https://nbdev.fast.ai'),
    ('#Local', '#Local', '#Local')])
def test_links(href, site, readme):
    assert docs.local_href(href) == site and docs.local_href(href, readme=True) == readme

def processed_nb():
    "A notebook as nbdev's processors leave it: front matter, maths, a link, an API entry, a long output, a hidden cell."
    import nbformat
    v4 = nbformat.v4
    api = v4.new_code_cell("#| echo: false\nshow_doc(f)", outputs=[v4.new_output('display_data', data={
        'text/markdown': "---\n\n### f\n\n>      f (x)\n\n*Doubles `x`.*", 'text/plain': '<IPython.core.display.Markdown object>'})])
    long = v4.new_code_cell("for i in range(100): print(i)", outputs=[v4.new_output('stream', name='stdout', text=''.join(f'{i}\n' for i in range(100)))])
    short = v4.new_code_cell("1 + 1", execution_count=3, outputs=[v4.new_output('execute_result', data={'text/plain': '2'}, execution_count=3)])
    return v4.new_notebook(cells=[
        v4.new_raw_cell("---\ntitle: 'core: semirings'\ndescription: The algebra.\n---"),
        v4.new_markdown_cell(f"[![Open In Colab]({colab.BADGE_IMG})](https://colab.research.google.com/github/a/b/blob/main/nbs/00_core.ipynb)"),
        v4.new_markdown_cell("## Sums over paths\n\nThe loss is $\\log Z = \\bigoplus_p s(p)$, see [`ctc_loss`](/ctc.html#ctc_loss) and [the CTC notebook](02_ctc.ipynb)."),
        api, long, short])

PAGES = [dict(href='index.html', title='Overview', full='seqdist'), dict(href='core.html', title='00 core', full='core: semirings'),
         dict(href='ctc.html', title='02 ctc', full='ctc: CTC')]

def test_page_reads_as_documentation():
    body, hs = docs.render_page(processed_nb(), '00_core.ipynb', PAGES)
    assert not re.search(r'In&nbsp;\[|In \[\d|Out\[\d', body)                                  # no execution prompts
    assert re.search(r'class="[^"]*celltag_api-entry', body) and 'show_doc' not in body       # API entry, its call hidden
    assert re.search(r'<details class="long-output"><summary>Output \(100 lines\)', body)     # long output folded
    assert body.count('<details') == 1                                                       # and only that one
    assert '<h1 id="core:-semirings"' in body and 'The algebra.' in body
    assert '<h2 id="sums-over-paths"' in body and '<a href="#sums-over-paths">Sums over paths</a>' in body   # sidebar TOC
    assert 'href="ctc.html#ctc_loss"' in body and 'href="ctc.html"' in body and 'src="colab-badge.svg"' in body
    side = re.search(r'<nav [^>]*class="site-sidebar"[^>]*>.*?</nav>', body, re.S).group()
    assert re.findall(r'<a href="(\w+)\.html">', side) == ['index', 'core', 'ctc'] and '<li class="current"><a href="core.html">' in side
    assert '<a class="prev" href="index.html">' in body and '<a class="next" href="ctc.html">' in body
    for tag in re.findall(r'<(?:script|link|img)\b[^>]*>', body):                             # nothing from the network
        assert not re.search(r'(?:src|href)="(?:https?:)?//', tag), tag
    assert 'src="katex/katex.min.js"' in body and 'src="katex/contrib/auto-render.min.js"' in body
    assert ('h2', 'sums-over-paths', 'Sums over paths') in [(f'h{l}', i, t) for l, i, t in hs]

# --- the headless-Chromium check -----------------------------------------------------------------------------------

needs_browser = pytest.mark.skipif(not (shutil.which('chromium') and shutil.which('node') and (docs.SITE / 'node_modules' / 'katex').exists()),
                                   reason="needs Debian's chromium, node and tools/site/node_modules (`make docs-check` installs them)")

@needs_browser
def test_check_passes_a_good_site_and_names_each_problem_of_a_bad_one(tmp_path):
    site = tmp_path / 'site'; site.mkdir()
    docs.copy_assets(site)
    search = []
    for name in ['index.ipynb', '00_core.ipynb']:            # a two-page site whose links all resolve
        body, hs = docs.render_page(processed_nb(), name, PAGES[:2])
        body = body.replace('href="ctc.html#ctc_loss"', 'href="core.html#sums-over-paths"').replace('href="ctc.html"', 'href="core.html"')
        (site / docs.page_name(name)).write_text(body)
        search += docs.search_entries(docs.page_name(name), name, hs)
    docs.write_search_index(site, search)
    check = lambda: subprocess.run(['node', str(docs.SITE / 'check.mjs'), str(site)], capture_output=True, text=True, timeout=120)
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'core.html: 1 formulas, 1 images' in r.stdout and 'search: "core: semirings" -> 2 results, including core.html#core:-semirings' in r.stdout
    assert (site / 'screenshots' / 'core.png').stat().st_size > 10_000
    bad = (body.replace('href="core.html#sums-over-paths"', 'href="core.html#nowhere"')
               .replace('href="core.html"', 'href="missing.html"')
               .replace('The loss is', 'Bad: $\\frac{1}$, costs $5 only. The loss is')
               .replace('</main>', '<img src="images/none.png"><script src="https://cdn.example.org/x.js"></script>'
                                   '<script>console.error("boom")</script></main>'))
    (site / 'core.html').write_text(bad)
    r = check()
    assert r.returncode == 1
    for problem in ['broken link core.html#nowhere', 'broken link missing.html', 'image does not load: images/none.png',
                    'asks the network for https://cdn.example.org/x.js', 'console error: boom', 'raw $ in the text', 'formula not rendered']:
        assert problem in r.stdout, (problem, r.stdout)

def test_readme_links_resolve_in_the_repository():
    "README.md (rendered from nbs/index.ipynb by `make readme`) links only to files that exist, or off-site."
    targets = re.findall(r'\]\(([^)\s]+)\)', (ROOT / 'README.md').read_text())
    local = [t for t in targets if not re.match(r'[a-z]+:', t)]
    assert local and all((ROOT / t.split('#')[0]).exists() for t in local), [t for t in local if not (ROOT / t.split('#')[0]).exists()]

# --- the benchmark chart (seqdist.bench.plot_speedups, seqdist-bench --plot) --------------------------------------

ROWS = [dict(op='ctc_loss fwd+bwd', shape='T=500 N=128', anchor='torch', anchor_ms=290.0, ours_ms=42.0, ratio=290 / 42, check='ok'),
        dict(op='forced_align', shape='32 x (T=200)', anchor='torchaudio (not installed)', anchor_ms=float('nan'), ours_ms=2.0,
             ratio=float('nan'), check='-'),
        dict(op='sparse.logZ fwd+bwd', shape='T=500 N=16 C=256', anchor='0.0.3', anchor_ms=900.0, ours_ms=80.0, ratio=11.25, check='ok')]

def bars(fig):
    from matplotlib.patches import Rectangle
    "Where each panel's bars end (they start at 1x)."
    return [[pytest.approx(p.get_x() + p.get_width()) for p in ax.patches if isinstance(p, Rectangle) if p.get_x() == 1] for ax in fig.axes]

def test_chart_has_a_bar_per_measured_row_and_says_what_was_not_measured(tmp_path):
    from seqdist.bench import plot_speedups
    fig = plot_speedups(ROWS, tmp_path / 'b.png')
    assert (tmp_path / 'b.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert bars(fig) == [[290 / 42, 11.25]]                          # one panel: speed-ups only
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ['6.90x', 'not measured', '11.25x']
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ['ctc_loss fwd+bwd\nT=500 N=128', 'forced_align\n32 x (T=200)', 'sparse.logZ fwd+bwd\nT=500 N=16 C=256']
    assert 'on cpu' in fig._suptitle.get_text()

def test_chart_memory_panel_and_devices():
    from seqdist.bench import plot_speedups
    rows = [dict(ROWS[0], anchor_mb=113.0, ours_mb=20.0), dict(ROWS[2], device='cuda', anchor_mb=50.0, ours_mb=100.0)]
    fig = plot_speedups(rows)
    assert bars(fig) == [[290 / 42, 11.25], [5.65, 0.5]]
    assert [t.get_text() for t in fig.axes[1].texts] == ['5.65x', '0.50x']
    assert '[cuda]' in fig.axes[0].get_yticklabels()[1].get_text() and 'cpu, cuda' in fig._suptitle.get_text()

def test_bench_cli_plot_option(tmp_path, monkeypatch, capsys):
    import seqdist.bench as bench
    monkeypatch.setattr(bench, 'run_benchmarks', lambda quick, device: [dict(r) for r in ROWS])
    monkeypatch.setattr(sys, 'argv', ['seqdist-bench', '--quick', '--plot', str(tmp_path / 'chart.png'), '--json', str(tmp_path / 'rows.json')])
    bench.bench_cli()
    out = capsys.readouterr().out
    assert '| ctc_loss fwd+bwd |' in out and f"chart written to {tmp_path / 'chart.png'}" in out
    assert (tmp_path / 'chart.png').stat().st_size > 10_000 and len(json.loads((tmp_path / 'rows.json').read_text())) == 3

def test_links_to_missing_anchors_fall_back_to_the_class_entry_or_the_page(tmp_path):
    (tmp_path / 'crf.html').write_text('<h3 id="ctc_crf">CTC_CRF</h3><a href="crf.html#ctc_crf.ctc_loss">m</a>'
                                       '<a href="#_private">p</a><a href="ctc.html#x.y">o</a><a href="crf.html#ctc_crf">ok</a>')
    (tmp_path / 'ctc.html').write_text('<h3 id="x">x</h3><a href="crf.html#nothing.here">n</a>')
    docs.resolve_anchors(tmp_path, ['crf.html', 'ctc.html'])
    assert (tmp_path / 'crf.html').read_text() == ('<h3 id="ctc_crf">CTC_CRF</h3><a href="crf.html#ctc_crf">m</a>'
                                                   '<a href="crf.html">p</a><a href="ctc.html#x">o</a><a href="crf.html#ctc_crf">ok</a>')
    assert (tmp_path / 'ctc.html').read_text() == '<h3 id="x">x</h3><a href="crf.html">n</a>'
