// The fallback docs site's scripts: maths with KaTeX (served with the site, no network), and a search box over the
// headings and API entries of every page (search-index.js, written by tools/docs.py).
document.addEventListener('DOMContentLoaded', () => {
  renderMathInElement(document.querySelector('.site-main'), {
    delimiters: [{left: '$$', right: '$$', display: true}, {left: '\\[', right: '\\]', display: true},
                 {left: '$', right: '$', display: false}, {left: '\\(', right: '\\)', display: false}],
    throwOnError: false,
  });
  const box = document.getElementById('site-search'), list = document.getElementById('site-search-results');
  const entries = window.SEQDIST_SEARCH || [];
  const show = () => {
    const words = box.value.toLowerCase().split(/\s+/).filter(Boolean);
    list.replaceChildren();
    if (!words.length) { list.hidden = true; return; }
    const hits = entries.filter(e => words.every(w => (e.text + ' ' + e.page).toLowerCase().includes(w))).slice(0, 30);
    for (const e of hits) {
      const li = document.createElement('li'), a = document.createElement('a'), span = document.createElement('span');
      a.href = e.href; a.textContent = e.text; span.className = 'page'; span.textContent = e.page;
      a.appendChild(span); li.appendChild(a); list.appendChild(li);
    }
    if (!hits.length) { const li = document.createElement('li'); li.textContent = ' No match'; list.appendChild(li); }
    list.hidden = false;
  };
  box.addEventListener('input', show);
  box.addEventListener('keydown', ev => { if (ev.key === 'Escape') { box.value = ''; show(); } });
  document.addEventListener('click', ev => { if (!list.contains(ev.target) && ev.target !== box) list.hidden = true; });
});
