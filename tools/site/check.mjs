// `make docs-check`: every page of the built site (argv[2], default _docs) loaded in headless Chromium (Debian's
// /usr/bin/chromium, or $CHROMIUM), served on 127.0.0.1 by this script. For each page it checks that
//   - it loads with no console error and no uncaught exception,
//   - it asks nothing of the network: every request goes to the local server (anything else is blocked and reported),
//   - every local link resolves: the file exists and, for `page.html#anchor`, the page has that anchor,
//   - every image loaded (naturalWidth > 0),
//   - the maths is rendered: KaTeX produced no error box, and no `$` is left in the text outside code,
//   - no execution prompt is shown and the sidebar is there,
// then that the search box of index.html finds an entry of another page,
// and saves a screenshot of its first screen to <site>/screenshots/<page>.png. Exits 1 listing every failure.
import http from 'node:http';
import fs from 'node:fs';
import path from 'node:path';
import { chromium } from 'playwright-core';

const site = path.resolve(process.argv[2] || '_docs');
const only = process.argv.slice(3);
const types = { '.html': 'text/html', '.css': 'text/css', '.js': 'text/javascript', '.svg': 'image/svg+xml',
  '.png': 'image/png', '.woff2': 'font/woff2', '.woff': 'font/woff', '.ttf': 'font/ttf', '.json': 'application/json' };
const server = http.createServer((req, res) => {
  const rel = decodeURIComponent(new URL(req.url, 'http://x').pathname);
  const file = path.join(site, rel.endsWith('/') ? rel + 'index.html' : rel);
  if (!file.startsWith(site) || !fs.existsSync(file) || !fs.statSync(file).isFile()) { res.writeHead(404); res.end(); return; }
  res.writeHead(200, { 'content-type': types[path.extname(file)] || 'application/octet-stream' });
  fs.createReadStream(file).pipe(res);
});
await new Promise(ok => server.listen(0, '127.0.0.1', ok));
const origin = `http://127.0.0.1:${server.address().port}`;

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
         '--disable-component-update', '--disable-sync'],
});
const pages = fs.readdirSync(site).filter(f => f.endsWith('.html') && (!only.length || only.includes(f))).sort();
fs.mkdirSync(path.join(site, 'screenshots'), { recursive: true });
const failures = [], anchors = {}, links = [];
const fail = (page, what) => failures.push(`${page}: ${what}`);
for (const name of pages) {
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await ctx.newPage();
  page.on('console', m => { if (m.type() === 'error') fail(name, `console error: ${m.text()}`); });
  page.on('pageerror', e => fail(name, `uncaught exception: ${e.message}`));
  page.on('requestfailed', r => { if (r.url().startsWith(origin)) fail(name, `request failed: ${r.url()}`); });
  page.on('response', r => { if (r.url().startsWith(origin) && r.status() >= 400) fail(name, `HTTP ${r.status()} for ${r.url()}`); });
  await page.route('**/*', route => {
    const url = route.request().url();
    if (url.startsWith(origin) || url.startsWith('data:')) return route.continue();
    fail(name, `asks the network for ${url}`);
    return route.abort();
  });
  const response = await page.goto(`${origin}/${name}`, { waitUntil: 'load' });
  if (!response || response.status() !== 200) { fail(name, `does not load (${response && response.status()})`); await ctx.close(); continue; }
  await page.waitForFunction(() => document.readyState === 'complete');
  await page.evaluate(() => document.fonts.ready);
  const info = await page.evaluate(() => {
    const main = document.querySelector('.site-main') || document.body;
    const raw = [];
    const walker = document.createTreeWalker(main, NodeFilter.SHOW_TEXT, {
      acceptNode: n => n.parentElement.closest('pre, code, script, style, .katex, textarea') ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT });
    for (let n; (n = walker.nextNode());) if (n.textContent.includes('$')) raw.push(n.textContent.trim().slice(0, 80));
    return {
      ids: [...document.querySelectorAll('[id]')].map(e => e.id),
      links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
      images: [...document.images].map(i => ({ src: i.getAttribute('src').slice(0, 80), ok: i.complete && i.naturalWidth > 0 })),
      formulas: main.querySelectorAll('.katex').length,
      errors: [...main.querySelectorAll('.katex-error')].map(e => e.getAttribute('title') || e.textContent),
      raw,
      prompts: [...main.querySelectorAll('.jp-InputPrompt, .jp-OutputPrompt')].filter(e => e.textContent.trim()).length,
      sidebar: document.querySelectorAll('.site-sidebar a').length,
    };
  });
  anchors[name] = new Set(info.ids);
  for (const href of info.links) links.push([name, href]);
  for (const im of info.images) if (!im.ok) fail(name, `image does not load: ${im.src}`);
  for (const e of info.errors) fail(name, `formula not rendered: ${e}`);
  for (const r of info.raw) fail(name, `raw $ in the text (formula not rendered?): "${r}"`);
  if (info.prompts) fail(name, `${info.prompts} execution prompts shown`);
  if (!info.sidebar) fail(name, 'no sidebar');
  await page.screenshot({ path: path.join(site, 'screenshots', name.replace(/\.html$/, '.png')) });
  console.log(`${name}: ${info.formulas} formulas, ${info.images.length} images, ${info.links.length} links`);
  await ctx.close();
}
// The search box finds API entries across pages (its index is search-index.js).
if (pages.includes('index.html') && pages.length > 1) {
  const page = await browser.newPage();
  await page.goto(`${origin}/index.html`, { waitUntil: 'load' });
  const heading = await page.evaluate(() => (window.SEQDIST_SEARCH || []).length);
  if (!heading) fail('index.html', 'the search index is empty');
  else {
    const first = await page.evaluate(() => window.SEQDIST_SEARCH.find(e => !e.href.startsWith('index.html')));
    await page.fill('#site-search', first.text);
    const hits = await page.$$eval('#site-search-results a', as => as.map(a => a.getAttribute('href')));
    if (!hits.includes(first.href)) fail('index.html', `searching "${first.text}" does not offer ${first.href} (got ${hits.slice(0, 5)})`);
    else console.log(`search: "${first.text}" -> ${hits.length} results, including ${first.href}`);
  }
  await page.close();
}
let external = 0;
for (const [from, href] of links) {
  if (/^[a-z][a-z0-9+.-]*:/i.test(href) || href.startsWith('//')) { external++; continue; }  // leaves the site: not followed
  const [file, frag] = href.split('#');
  const target = file === '' ? from : path.posix.normalize(path.posix.join(path.posix.dirname(from), file));
  const abs = path.join(site, target);
  if (!fs.existsSync(abs)) { fail(from, `broken link ${href} (no ${target})`); continue; }
  if (frag && target.endsWith('.html')) {
    if (!anchors[target]) { if (!only.length) fail(from, `link ${href}: ${target} was not checked`); continue; }
    if (!anchors[target].has(decodeURIComponent(frag))) fail(from, `broken link ${href} (no #${frag} in ${target})`);
  }
}
await browser.close();
server.close();
console.log(`${pages.length} pages, ${links.length} links (${external} external, not followed); screenshots in ${path.join(site, 'screenshots')}`);
if (failures.length) {
  console.log(`\n${failures.length} problems:\n` + failures.map(f => '  ' + f).join('\n'));
  process.exit(1);
}
console.log('docs-check: every page loads with no console error, every local link and image resolves, every formula is rendered');
