// Injected by tests/test_html.py into a harness page of iframes (one per page and width):
// what the browser laid out, as JSON in <pre id="result">, read back through --dump-dom.
function overflowing(doc, win) {
  // elements whose right edge passes the viewport, outside a box that scrolls on its own
  const out = [];
  for (const el of doc.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.right <= win.innerWidth + 0.5) continue;
    let p = el.parentElement, scrolls = false;
    while (p && p !== doc.body) {
      const s = win.getComputedStyle(p);
      if (s.overflowX === 'auto' || s.overflowX === 'scroll' || s.overflowX === 'hidden') { scrolls = true; break; }
      p = p.parentElement;
    }
    if (!scrolls) out.push(el.tagName.toLowerCase() + (el.className && el.className.baseVal === undefined ? '.' + el.className : '') + ' right=' + Math.round(r.right));
  }
  return out.slice(0, 10);
}
function measure(doc, win) {
  const res = {width: win.innerWidth, scrollWidth: doc.documentElement.scrollWidth,
               overflowing: overflowing(doc, win), plots: [], html_font_px: []};
  for (const svg of doc.querySelectorAll('svg.plot')) {
    const box = svg.getBoundingClientRect();
    const plot = {plot: svg.dataset.plot, cls: svg.getAttribute('class'), shown: box.width > 0,
                  box: [box.left, box.top, box.right, box.bottom], texts: [], bars: [], marks: {}};
    if (box.width > 0) {
      const scale = box.width / svg.viewBox.baseVal.width;
      for (const t of svg.querySelectorAll('text')) {
        const r = t.getBoundingClientRect();
        plot.texts.push({cls: t.getAttribute('class') || '', text: t.textContent,
                         px: parseFloat(win.getComputedStyle(t).fontSize) * scale,
                         box: [r.left, r.top, r.right, r.bottom]});
      }
      for (const b of svg.querySelectorAll('rect.bar')) {
        const r = b.getBoundingClientRect();
        plot.bars.push({title: b.querySelector('title').textContent, x0: r.left, x1: r.right});
      }
      for (const m of svg.querySelectorAll('.culprit-mark, .failing-mark, circle.point')) {
        const r = m.getBoundingClientRect();
        (plot.marks[m.getAttribute('class')] = plot.marks[m.getAttribute('class')] || []).push((r.left + r.right) / 2);
      }
    }
    res.plots.push(plot);
  }
  for (const el of doc.body.querySelectorAll('p, li, td, th, code, h1, h2, summary, b')) {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && el.textContent.trim()) res.html_font_px.push(parseFloat(win.getComputedStyle(el).fontSize));
  }
  res.html_font_px = [Math.min(...res.html_font_px)];
  const hit = doc.querySelector('tr.hit td');          // the culprit's row in the first table with one
  res.tables = [...doc.querySelectorAll('table')].map(t => {
    const row = t.querySelector('tr.hit');
    return row ? [...row.querySelectorAll('td')].map(td => td.textContent.trim()) : null;
  }).filter(x => x);
  return res;
}
window.addEventListener('load', () => {
  const res = {};
  for (const f of document.querySelectorAll('iframe')) {
    try {
      res[f.id] = measure(f.contentDocument, f.contentWindow);
      // for the screenshot: the frame scrolled to its first plot shown
      const shown = res[f.id].plots.find(p => p.shown);
      if (shown) f.contentWindow.scrollTo(0, shown.box[1] - 40);
    } catch (e) { res[f.id] = {error: String(e)}; }
  }
  document.getElementById('result').textContent = JSON.stringify(res);
});
