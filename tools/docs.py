"""Docs without Quarto.

`python tools/docs.py readme`: README.md from nbs/index.ipynb (nbdev-processed, with the outputs committed in the
notebook, so that the file is reproducible; links into the docs site point at the notebooks instead, which GitHub
renders).

`python tools/docs.py html [--reuse] [NOTEBOOK ...]`: run the notebooks (all of them, or the ones named, e.g.
`00_core`; with `--reuse`, those not already run into _proc_exec/: for iterating on the layout), process them with nbdev's doc processors (hidden cells removed, `show_doc` for exported
names) and render them with nbconvert and tools/site/templates/seqdist into a static site in _docs/: one page per
notebook, named as Quarto names them (`02_ctc.ipynb` -> `ctc.html`), with no execution prompts, API entries as
boxes, long outputs folded, a sidebar listing the notebooks in reading order (index, then the numbered notebooks by
number: new notebooks appear without editing anything), a search box, and the maths rendered by KaTeX, which
`make docs` installs from npm (tools/site) and which is copied into the site: nothing is fetched from the network
when a page is read. Links are made relative (README-style `/ctc.html#ctc_loss`, `02_ctc.ipynb`, `show_doc`'s).

`python tools/docs.py execute NB OUT` (used by `html`): run one notebook, write it with its outputs to OUT.

`python tools/docs.py proc`: nbdev's doc processing of every notebook, unexecuted (what `make test` checks).

`python tools/docs.py check`: load every page of _docs/ in headless Chromium (tools/site/check.mjs): see there.

Quarto, where installed, is used by `make docs` instead of `html`."""
import html as htmllib, json, os, re, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS, OUT, SITE = ROOT / 'nbs', ROOT / '_docs', ROOT / 'tools' / 'site'
COLAB_BADGE = 'https://colab.research.google.com/assets/colab-badge.svg'
LONG_OUTPUT_LINES = 30          # outputs longer than this are folded under a <details>

def page_name(nb_name):
    "The page a notebook becomes, as Quarto names it: `02_ctc.ipynb` -> `ctc.html`, `index.ipynb` -> `index.html`."
    return re.sub(r'^\d+[a-z]?_', '', Path(nb_name).stem) + '.html'

def notebooks(nbs_dir=NBS):
    "The notebooks of the site in reading order: index first, then every `NN_name.ipynb` by its number."
    numbered = sorted((p for p in Path(nbs_dir).glob('*.ipynb') if re.match(r'\d+[a-z]?_', p.name)),
                      key=lambda p: (int(re.match(r'\d+', p.name).group()), p.name))
    index = [Path(nbs_dir) / 'index.ipynb'] if (Path(nbs_dir) / 'index.ipynb').exists() else []
    return index + numbered

def title_of(path):
    "(short, full) title of a notebook from its first markdown cell `# name: what it is`."
    cells = json.loads(Path(path).read_text())['cells']
    first = next((''.join(c['source']) for c in cells if c['cell_type'] == 'markdown'), '')
    m = re.match(r'#\s+(.*)', first.strip())
    full = m.group(1).strip() if m else Path(path).stem
    if Path(path).name == 'index.ipynb': return 'Overview', full
    number = re.match(r'(\d+[a-z]?)_', Path(path).name).group(1)
    return f"{number} {full.split(':')[0].strip()}", full

def local_href(href, readme=False):
    """A link as the site (or, with `readme`, GitHub's view of README.md) can follow it: root-relative `/ctc.html#x`
    and notebook links `02_ctc.ipynb#x` become `ctc.html#x` (fragments lower-cased, as the page's anchors are);
    external links and in-page anchors are left alone."""
    if re.match(r'[a-z][a-z0-9+.-]*:|//|#', href): return href
    path, _, frag = href.partition('#')
    path = path.lstrip('/')
    if readme:                   # README.md sits at the root: a page or notebook -> the notebook (GitHub renders it)
        hits = [p for p in notebooks() if path in (page_name(p.name), p.name)]
        if hits: return f"nbs/{hits[0].name}"
        return f"nbs/{href}" if path and not path.startswith('../') and (NBS / path).exists() else href   # e.g. images/
    path = re.sub(r'^(?:\.\./)?(?:nbs/)?([\w-]+)\.ipynb$', lambda m: page_name(m.group(1)), path)
    return path + ('#' + frag.lower() if frag else '')

def processed(nbs_dir, file_glob=''):
    "Run nbdev's doc processors over the notebooks in `nbs_dir` (or those matching file_glob); return the output folder."
    from nbdev.serve import proc_nbs
    import warnings
    os.chdir(ROOT)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return Path(proc_nbs(path=str(nbs_dir), n_workers=0, force=True, file_glob=file_glob))

def proc():
    """nbdev's doc processing of every notebook, as `make docs` runs it once the notebooks are executed: it runs again
    the cells that export, import or call `show_doc` (and only those: a cell that imports and uses a name from a cell
    that is not one of them fails there, not in nbdev-test). `make test` runs this, so a broken site cannot land."""
    out = processed(NBS)
    print(f"nbdev's doc processing ran over {len(notebooks())} notebooks into {out.relative_to(ROOT)}/")

def readme():
    """README.md from nbs/index.ipynb as committed (nbdev's doc processing runs none of its cells: it has no exports
    and no `show_doc`), outputs included; cells marked `#| echo: false` show their output only, and code blocks say
    they are Python."""
    import nbformat
    from nbconvert import MarkdownExporter
    from nbconvert.preprocessors import TagRemovePreprocessor
    nb = nbformat.read(processed(NBS, 'index.ipynb') / 'index.ipynb', as_version=4)
    nb.metadata['language_info'] = {'name': 'python'}
    for c in nb.cells:
        if c.cell_type == 'code' and re.search(r'^#\|\s*echo:\s*false\s*$', c.source, re.M):
            c.metadata.setdefault('tags', []).append('remove_input')
    exporter = MarkdownExporter()
    exporter.register_preprocessor(TagRemovePreprocessor(remove_input_tags={'remove_input'}), enabled=True)
    body, _ = exporter.from_notebook_node(nb)
    body = re.sub(r'\A\s*---\n.*?\n---\n', '', body, flags=re.S)        # Quarto front matter
    body = re.sub(r'\n{3,}', '\n\n', body)                                 # nbconvert's blank lines around outputs
    body = re.sub(r'<!-- WARNING: THIS FILE WAS AUTOGENERATED.*?-->\s*', '', body)
    body = re.sub(r'\]\(([^)\s]+)\)', lambda m: f"]({local_href(m.group(1), readme=True)})", body)
    first = nbformat.read(NBS / 'index.ipynb', as_version=4).cells[0].source  # title and summary
    note = "<!-- Generated from nbs/index.ipynb by `make readme` (tools/docs.py): edit the notebook, not this file. -->"
    (ROOT / 'README.md').write_text(f"{first.strip()}\n\n{body.strip()}\n\n{note}\n")
    print("README.md written from nbs/index.ipynb")

def execute_one(path, out):
    "Run one notebook where it lives (so that its relative paths hold), skipping the cells nbdev-test skips."
    from execnb.shell import CaptureShell
    from fastcore.nbio import read_nb, write_nb
    needs_gpu = lambda c: bool(re.search(r'^#\|\s*(cuda|notest)\b', c.source, re.M))
    path = Path(path).resolve(); out = Path(out).resolve()
    nb = read_nb(path)
    os.chdir(path.parent)
    CaptureShell().run_all(nb, exc_stop=True, preproc=needs_gpu)
    write_nb(nb, out)

def execute(paths, build, jobs=2):
    """Run the notebooks, each in a process of its own (as nbdev-test does: notebooks that register the same custom
    ops must not share one), `jobs` at a time; stop on the first that fails."""
    from concurrent.futures import ThreadPoolExecutor
    def run(path):
        r = subprocess.run([sys.executable, __file__, 'execute', str(path), str(build / path.name)], capture_output=True, text=True)
        print(f"executed {path.name}" if r.returncode == 0 else f"FAILED {path.name}:\n{r.stdout}{r.stderr}", flush=True)
        return r.returncode
    with ThreadPoolExecutor(jobs) as pool:
        if any(list(pool.map(run, paths))): sys.exit("a notebook failed: no docs written")

def output_lines(o):
    "How many lines an output shows (text, or rows of an HTML table)."
    if o.get('output_type') == 'stream': return ''.join(o.get('text', '')).count('\n')
    data = o.get('data', {})
    if 'text/html' in data: return ''.join(data['text/html']).count('<tr')
    if 'image/png' in data or 'text/markdown' in data: return 0
    return ''.join(data.get('text/plain', '')).count('\n')

def prepare(nb, name):
    "Turn an nbdev-processed notebook into what the page template expects; return its front matter."
    import nbformat, yaml
    front = {}
    if nb.cells and nb.cells[0].cell_type == 'raw' and nb.cells[0].source.startswith('---'):  # Quarto front matter
        front = yaml.safe_load(nb.cells[0].source.strip().strip('-')) or {}
        desc = f"\n\n> {front['description']}" if front.get('description') else ''
        nb.cells[0] = nbformat.v4.new_markdown_cell(f"# {front.get('title', name)}{desc}")
    keep = {'code': {'id', 'cell_type', 'source', 'metadata', 'outputs', 'execution_count'},
            'markdown': {'id', 'cell_type', 'source', 'metadata', 'attachments'}, 'raw': {'id', 'cell_type', 'source', 'metadata'}}
    for c in nb.cells:  # nbdev's processors leave bookkeeping keys that nbformat's schema rejects
        echo = '#| echo: false' not in c.source
        for k in set(c) - keep[c.cell_type]: del c[k]
        c.metadata = {k: v for k, v in c.metadata.items() if k in ('tags', 'jupyter', 'collapsed')}
        if c.cell_type == 'markdown':
            c.source = c.source.replace(COLAB_BADGE, 'colab-badge.svg')   # the site serves its own copy
        if c.cell_type != 'code': continue
        c.setdefault('outputs', []); c.setdefault('execution_count', None)
        tags = c.metadata.get('tags', [])
        if not echo: tags.append('remove_input')
        if re.match(r'\s*(#\|.*\n)*\s*show_doc\(', c.source): tags.append('api-entry')
        c.metadata['tags'] = tags
        c.source = re.sub(r'^#\|.*\n?', '', c.source, flags=re.M)       # nbdev/Quarto directives
        for o in c.outputs:                                               # Quarto-only link attributes
            if 'text/markdown' in o.get('data', {}):
                o['data']['text/markdown'] = re.sub(r'\[source\]\([^)]*\)\{[^}]*\}|\{target=[^}]*\}', '', ''.join(o['data']['text/markdown']))
        n = sum(output_lines(o) for o in c.outputs)
        if n > LONG_OUTPUT_LINES: c.metadata['long_output_lines'] = n
    return front

def fix_page(body):
    "Relative links with lower-case fragments, lower-case heading anchors (as Quarto's and nbdev's links expect)."
    body = re.sub(r'(<h[1-6] id=")([^"]*)"', lambda m: m.group(1) + m.group(2).lower() + '"', body)
    body = re.sub(r'(<a\b[^>]*?\bhref=")([^"]*)"', lambda m: m.group(1) + htmllib.escape(local_href(htmllib.unescape(m.group(2)))) + '"', body)
    body = re.sub(r'(<a\b[^>]*?\bhref="#)([^"]*)"', lambda m: m.group(1) + m.group(2).lower() + '"', body)
    return body

def headings(body, levels='123'):
    "[(level, id, text)] of the page's headings."
    out = []
    for m in re.finditer(rf'<h([{levels}]) id="([^"]+)"[^>]*>(.*?)</h\1>', body, re.S):
        text = htmllib.unescape(re.sub(r'<[^>]+>', '', m.group(3))).replace('¶', '').strip()
        out.append((int(m.group(1)), m.group(2), text))
    return out

def copy_assets(out):
    katex = SITE / 'node_modules' / 'katex' / 'dist'
    if not katex.exists():
        sys.exit(f"{katex} is missing: run `make docs` (or `cd tools/site && npm ci`) to install KaTeX from npm")
    shutil.copytree(katex, out / 'katex', ignore=shutil.ignore_patterns('*.mjs', 'katex.js', 'katex.css', '*swap*', 'README.md'))
    for f in ('site.css', 'site.js', 'colab-badge.svg'): shutil.copy(SITE / f, out / f)
    if (NBS / 'images').exists(): shutil.copytree(NBS / 'images', out / 'images')   # figures the prose links

def render_page(nb, nb_name, pages):
    """The HTML page of an nbdev-processed notebook `nb` (named `nb_name`), with `pages` ([{href, title, full}], in
    reading order) in its sidebar; returns (html, [(level, id, text)] of its headings)."""
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor
    import seqdist
    prepare(nb, Path(nb_name).stem)
    exporter = HTMLExporter(template_name='seqdist', extra_template_basedirs=[str(SITE / 'templates')],
                            exclude_input_prompt=True, exclude_output_prompt=True)
    exporter.register_preprocessor(TagRemovePreprocessor(remove_input_tags={'remove_input'}), enabled=True)
    i = [q['href'] for q in pages].index(page_name(nb_name))
    nb.metadata['title'] = f"{pages[i]['full']} · seqdist"
    site = dict(name='seqdist', version=seqdist.__version__, pages=pages, current=pages[i]['href'],
                prev=pages[i - 1] if i > 0 else None, next=pages[i + 1] if i + 1 < len(pages) else None)
    body, _ = exporter.from_notebook_node(nb, resources=dict(site=site))
    body = fix_page(body)
    hs = headings(body)
    toc = ''.join(f'<li><a href="#{hid}">{htmllib.escape(t)}</a></li>' for lvl, hid, t in hs if lvl == 2)
    return body.replace('<!--SITE-TOC-->', f'<ul class="site-toc">{toc}</ul>' if toc else '', 1), hs

def resolve_anchors(out, hrefs):
    """Links into a page for an anchor it does not have (nbdev links every backticked name, but only shows the
    entries of exported functions and classes): `page.html#cls.method` -> the class's entry `page.html#cls`, else the
    page itself. Only links into the pages `hrefs` (those rendered) are touched."""
    ids = {h: set(re.findall(r'\bid="([^"]+)"', (out / h).read_text())) for h in hrefs}
    def fix(m, here):
        page, frag = m.group(2) or here, m.group(3)
        if page not in ids or frag in ids[page]: return m.group(0)
        while '.' in frag and frag not in ids[page]: frag = frag.rsplit('.', 1)[0]
        target = (m.group(2) or '') + ('#' + frag if frag in ids[page] else '')
        return f'{m.group(1)}{target or here}"'
    for h in hrefs:
        body = (out / h).read_text()
        (out / h).write_text(re.sub(r'(<a\b[^>]*?\bhref=")([\w.-]+\.html)?#([^"]+)"', lambda m: fix(m, h), body))

def search_entries(href, page_title, hs):
    "What the search box offers for a page: each of its headings (sections and API entries)."
    return [dict(text=t, href=f"{href}#{hid}", page=page_title) for lvl, hid, t in hs]

def write_search_index(out, entries):
    "search-index.js: a script, not JSON fetched by site.js, so that search works from file:// too."
    (out / 'search-index.js').write_text('window.SEQDIST_SEARCH = ' + json.dumps(entries, indent=0) + ';\n')

def html(only=(), reuse=False):
    import nbformat
    all_nbs = notebooks()
    chosen = [p for p in all_nbs if not only or p.stem in only or p.name in only]
    if only and len(chosen) != len(only): sys.exit(f"unknown notebook in {only}: have {[p.stem for p in all_nbs]}")
    build = ROOT / '_proc_exec'                 # the executed notebooks, kept for `--reuse` (layout work)
    todo = [p for p in chosen if not (reuse and (build / p.name).exists())]
    if not reuse: shutil.rmtree(build, ignore_errors=True)
    build.mkdir(exist_ok=True)
    execute(todo, build)
    proc = processed(build)
    shutil.rmtree(OUT, ignore_errors=True); OUT.mkdir()
    copy_assets(OUT)
    pages = [dict(href=page_name(p.name), title=title_of(p)[0], full=title_of(p)[1]) for p in all_nbs]
    search = []
    for path in chosen:
        body, hs = render_page(nbformat.read(proc / path.name, as_version=4), path.name, pages)
        href = page_name(path.name)
        (OUT / href).write_text(body)
        search += search_entries(href, title_of(path)[0], hs)
    resolve_anchors(OUT, [page_name(p.name) for p in chosen])
    write_search_index(OUT, search)
    missing = [q['href'] for q in pages if not (OUT / q['href']).exists()]
    print(f"docs written to {OUT}/ ({len(chosen)} pages{'; not rendered: ' + ', '.join(missing) if missing else ''}): "
          f"open {OUT / 'index.html'}")

def check(args=()):
    "Every page of _docs/ in headless Chromium: see tools/site/check.mjs."
    sys.exit(subprocess.call(['node', str(SITE / 'check.mjs'), str(OUT), *args]))

if __name__ == '__main__':
    cmd, rest = sys.argv[1], sys.argv[2:]
    {'readme': readme, 'proc': proc, 'html': lambda: html(tuple(r for r in rest if r != '--reuse'), '--reuse' in rest), 'check': lambda: check(rest),
     'execute': lambda: execute_one(*rest)}[cmd]()
