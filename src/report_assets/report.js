// report.js — draws nanguard's HTML report from the JSON embedded in the page
// (<script id="nanguard-data">, written by src/report.cpp). Plain DOM + SVG,
// no libraries, no network. When done, <body data-rendered="N"> counts the
// plots drawn; errors go to #errors (see the capture script in the head).
(function () {
  'use strict';

  var SVGNS = 'http://www.w3.org/2000/svg';
  var PALETTE = ['#2f6fdb', '#e8710a', '#12a37f', '#9b51e0', '#d63384', '#0b9dbf', '#8a6d00', '#5c6bc0', '#c2185b'];
  var HEIGHT = 210, MARGIN = { left: 62, right: 14, top: 10, bottom: 26 };

  // ------------------------------------------------------------ helpers
  // JSON has no NaN/Inf: the report writes them as "nan", "inf", "-inf".
  function num(v) {
    if (typeof v === 'number') return v;
    if (v === 'inf') return Infinity;
    if (v === '-inf') return -Infinity;
    return NaN;
  }

  function fmt(v) {
    v = num(v);
    if (isNaN(v)) return 'NaN';
    if (v === Infinity) return '+Inf';
    if (v === -Infinity) return '-Inf';
    if (v === 0) return '0';
    var a = Math.abs(v);
    if (a >= 1e5 || a < 1e-3) return v.toExponential(2).replace(/\.?0+e/, 'e').replace('e+', 'e');
    if (Number.isInteger(v)) return String(v);
    return String(+v.toPrecision(4));
  }

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function svgEl(tag, attrs) {
    var e = document.createElementNS(SVGNS, tag);
    for (var k in attrs) if (Object.prototype.hasOwnProperty.call(attrs, k)) e.setAttribute(k, attrs[k]);
    return e;
  }

  // How the run ended, decided from its events by the report (run_summary.h).
  function status(run) {
    return run.status;
  }

  // "Nice" linear ticks covering [lo, hi].
  function linearTicks(lo, hi, count) {
    var span = hi - lo;
    if (!(span > 0)) return [lo];
    var step = Math.pow(10, Math.floor(Math.log10(span / count)));
    var err = span / count / step;
    if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
    var ticks = [];
    for (var t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Math.abs(t) < step * 1e-9 ? 0 : t);
    return ticks;
  }

  function logTicks(lo, hi) {
    var a = Math.floor(Math.log10(lo)), b = Math.ceil(Math.log10(hi));
    var every = Math.max(1, Math.ceil((b - a) / 6)), ticks = [];
    for (var p = a; p <= b; p += every) {
      var t = Math.pow(10, p);
      if (t >= lo * 0.999 && t <= hi * 1.001) ticks.push(t);
    }
    if (ticks.length < 2) return linearTicks(lo, hi, 4).filter(function (t) { return t > 0; });
    return ticks;
  }

  // Index of the point of sorted `xs` nearest to `x`.
  function nearest(xs, x) {
    var lo = 0, hi = xs.length - 1;
    if (hi < 0) return -1;
    while (hi - lo > 1) {
      var mid = (lo + hi) >> 1;
      if (xs[mid] <= x) lo = mid; else hi = mid;
    }
    return Math.abs(xs[lo] - x) <= Math.abs(xs[hi] - x) ? lo : hi;
  }

  // ------------------------------------------------------------ plot
  // One chart: series [{name, x, y (numbers), color, width}], the run's marks,
  // and a log-scale toggle when the values span decades.
  function Plot(parent, spec, run, cursorGroup) {
    this.spec = spec;
    this.run = run;
    this.cursorGroup = cursorGroup;
    this.hidden = {};
    var finite = [];
    spec.series.forEach(function (s) { s.y.forEach(function (v) { if (isFinite(v)) finite.push(v); }); });
    var min = Infinity, max = -Infinity;
    for (var i = 0; i < finite.length; ++i) { if (finite[i] < min) min = finite[i]; if (finite[i] > max) max = finite[i]; }
    this.canLog = finite.length > 0 && min > 0;
    this.log = this.canLog && max / min >= 1e3;

    this.root = el('div', 'plot');
    this.root.setAttribute('data-plot', spec.id);
    this.root.plot = this;
    var head = el('div', 'plot-head');
    head.appendChild(el('span', 'plot-title', spec.title));
    var self = this;
    if (this.canLog) {
      var label = el('label');
      var box = document.createElement('input');
      box.type = 'checkbox';
      box.checked = this.log;
      box.addEventListener('change', function () { self.log = box.checked; self.draw(); });
      label.appendChild(box);
      label.appendChild(document.createTextNode(' log scale'));
      head.appendChild(label);
    }
    var legend = el('div', 'legend');
    spec.series.forEach(function (s) {
      var item = el('span', 'item');
      var sw = el('span', 'swatch');
      sw.style.background = s.color;
      item.appendChild(sw);
      item.appendChild(document.createTextNode(s.name));
      if (spec.series.length > 1) {
        item.title = 'show / hide';
        item.addEventListener('click', function () {
          self.hidden[s.name] = !self.hidden[s.name];
          item.classList.toggle('off', !!self.hidden[s.name]);
          self.draw();
        });
      }
      legend.appendChild(item);
    });
    var nonfinite = 0;
    spec.series.forEach(function (s) { s.y.forEach(function (v) { if (!isFinite(v)) ++nonfinite; }); });
    if (nonfinite) legend.appendChild(el('span', 'item', '\u25B2 +Inf  \u00D7 NaN  \u25BC -Inf')).className = 'item mark';
    head.appendChild(legend);
    this.root.appendChild(head);
    this.holder = el('div');
    this.root.appendChild(this.holder);
    this.tip = el('div', 'tooltip');
    this.tip.hidden = true;
    this.root.appendChild(this.tip);
    parent.appendChild(this.root);
    cursorGroup.push(this);
    this.draw();
  }

  Plot.prototype.draw = function () {
    var spec = this.spec, run = this.run, self = this;
    var width = Math.max(480, Math.round(this.holder.clientWidth || 900));
    var w = width - MARGIN.left - MARGIN.right, h = HEIGHT - MARGIN.top - MARGIN.bottom;
    var svg = svgEl('svg', { 'class': 'chart', viewBox: '0 0 ' + width + ' ' + HEIGHT, width: width, height: HEIGHT,
      role: 'img', 'aria-label': spec.title });
    var visible = spec.series.filter(function (s) { return !self.hidden[s.name]; });

    // x: the run's step range, shared by all its plots.
    var x0 = run.first_step, x1 = run.last_step;
    if (x1 <= x0) { x0 -= 1; x1 += 1; }
    var sx = function (x) { return MARGIN.left + (x - x0) / (x1 - x0) * w; };

    // y: the finite values (positive ones on a log scale), padded a little.
    var lo = Infinity, hi = -Infinity, log = this.log;
    visible.forEach(function (s) {
      s.y.forEach(function (v) { if (isFinite(v) && (!log || v > 0)) { if (v < lo) lo = v; if (v > hi) hi = v; } });
    });
    var empty = !(lo <= hi);
    if (empty) { lo = log ? 1 : 0; hi = log ? 10 : 1; }
    if (log) {
      if (hi / lo < 10) { var mid = Math.sqrt(hi * lo); lo = mid / Math.sqrt(10); hi = mid * Math.sqrt(10); }
      var pad = Math.pow(hi / lo, 0.04); lo /= pad; hi *= pad;
    } else {
      if (hi === lo) { var d = Math.abs(hi) * 0.1 || 1; lo -= d; hi += d; }
      var p = (hi - lo) * 0.05; lo -= p; hi += p;
      if (lo < 0 && visible.every(function (s) { return s.y.every(function (v) { return !isFinite(v) || v >= 0; }); })) lo = 0;
    }
    var sy = log
      ? function (v) { return MARGIN.top + (1 - (Math.log(v) - Math.log(lo)) / (Math.log(hi) - Math.log(lo))) * h; }
      : function (v) { return MARGIN.top + (1 - (v - lo) / (hi - lo)) * h; };

    // grid and axes
    var yt = log ? logTicks(lo, hi) : linearTicks(lo, hi, 4);
    yt.forEach(function (t) {
      var y = sy(t).toFixed(1);
      svg.appendChild(svgEl('line', { 'class': 'grid', x1: MARGIN.left, x2: MARGIN.left + w, y1: y, y2: y }));
      var label = svgEl('text', { x: MARGIN.left - 6, y: y, 'text-anchor': 'end', 'dominant-baseline': 'middle' });
      label.textContent = fmt(t);
      svg.appendChild(label);
    });
    linearTicks(x0, x1, Math.max(2, Math.floor(w / 90))).forEach(function (t) {
      if (Math.floor(t) !== t) return;
      var x = sx(t).toFixed(1);
      svg.appendChild(svgEl('line', { 'class': 'grid', x1: x, x2: x, y1: MARGIN.top, y2: MARGIN.top + h }));
      var label = svgEl('text', { x: x, y: MARGIN.top + h + 16, 'text-anchor': 'middle' });
      label.textContent = String(t);
      svg.appendChild(label);
    });
    svg.appendChild(svgEl('line', { 'class': 'axis', x1: MARGIN.left, x2: MARGIN.left, y1: MARGIN.top, y2: MARGIN.top + h }));
    svg.appendChild(svgEl('line', { 'class': 'axis', x1: MARGIN.left, x2: MARGIN.left + w, y1: MARGIN.top + h, y2: MARGIN.top + h }));

    // skipped steps: shaded bands (one path); rollbacks and aborts: vertical lines
    var band = '';
    (run.skipped_ranges || []).forEach(function (r) {
      var a = sx(r[0] - 0.5), b = sx(r[1] + 0.5);
      a = Math.max(a, MARGIN.left); b = Math.min(b, MARGIN.left + w);
      if (b - a < 1.5) { var c = (a + b) / 2; a = c - 0.75; b = c + 0.75; }
      band += 'M' + a.toFixed(1) + ' ' + MARGIN.top + 'H' + b.toFixed(1) + 'V' + (MARGIN.top + h) + 'H' + a.toFixed(1) + 'Z';
    });
    if (band) {
      var bp = svgEl('path', { 'class': 'skipband', d: band });
      bp.appendChild(svgEl('title', {})).textContent = 'skipped steps';
      svg.appendChild(bp);
    }
    (run.rollback_marks || []).forEach(function (m) {
      var x = sx(m.step).toFixed(1);
      var ln = svgEl('line', { 'class': 'rollback', x1: x, x2: x, y1: MARGIN.top, y2: MARGIN.top + h });
      ln.appendChild(svgEl('title', {})).textContent = 'step ' + m.step + ': rollback to step ' + m.to;
      svg.appendChild(ln);
    });
    (run.abort_marks || []).forEach(function (s) {
      var x = sx(s).toFixed(1);
      var ln = svgEl('line', { 'class': 'abort', x1: x, x2: x, y1: MARGIN.top, y2: MARGIN.top + h });
      ln.appendChild(svgEl('title', {})).textContent = 'step ' + s + ': abort';
      svg.appendChild(ln);
    });

    // lines over the finite points; NaN/Inf (and values <= 0 on a log
    // scale) as markers on the plot's edge
    var top = MARGIN.top + 4, bottom = MARGIN.top + h - 4;
    visible.forEach(function (s) {
      var d = '', marks = '', crosses = '', started = false, drawn = 0, lastX = 0, lastY = 0;
      for (var i = 0; i < s.x.length; ++i) {
        var v = s.y[i], x = sx(s.x[i]);
        if (isFinite(v) && (!log || v > 0)) {
          d += (started ? 'L' : 'M') + x.toFixed(1) + ' ' + sy(v).toFixed(1);
          started = true;
          ++drawn; lastX = x; lastY = sy(v);
        } else if (v === Infinity) {
          marks += 'M' + x.toFixed(1) + ' ' + (top - 4) + 'l4 7h-8z';
        } else if (v === -Infinity || (log && isFinite(v))) {
          marks += 'M' + x.toFixed(1) + ' ' + (bottom + 4) + 'l4 -7h-8z';
        } else {
          crosses += 'M' + (x - 3.5).toFixed(1) + ' ' + (top - 3.5) + 'l7 7m0 -7l-7 7';
        }
      }
      if (d) svg.appendChild(svgEl('path', { 'class': 'line', d: d, stroke: s.color, 'stroke-width': s.width || 1.5,
        'data-series': s.name }));
      // A lone finite point makes no line: draw it as a dot.
      if (drawn === 1) svg.appendChild(svgEl('circle', { 'class': 'dot', cx: lastX.toFixed(1), cy: lastY.toFixed(1), r: 3,
        fill: s.color }));
      if (marks) svg.appendChild(svgEl('path', { 'class': 'nonfinite', d: marks, 'data-series': s.name + ' (Inf)' }));
      if (crosses) svg.appendChild(svgEl('path', { 'class': 'nonfinite nan', d: crosses, 'data-series': s.name + ' (NaN)' }));
    });
    if (empty) {
      var note = svgEl('text', { 'class': 'empty-note', x: MARGIN.left + w / 2, y: MARGIN.top + h / 2, 'text-anchor': 'middle' });
      note.textContent = visible.length ? 'no finite values' : 'no series shown';
      svg.appendChild(note);
    }

    this.cursor = svgEl('line', { 'class': 'cursor', x1: 0, x2: 0, y1: MARGIN.top, y2: MARGIN.top + h, visibility: 'hidden' });
    svg.appendChild(this.cursor);
    var overlay = svgEl('rect', { x: MARGIN.left, y: MARGIN.top, width: w, height: h, fill: 'transparent' });
    svg.appendChild(overlay);
    this.sx = sx;
    this.x0 = x0; this.x1 = x1; this.w = w; this.width = width;
    overlay.addEventListener('mousemove', function (ev) {
      var box = svg.getBoundingClientRect();
      var px = (ev.clientX - box.left) * width / box.width;
      var step = Math.round(x0 + (px - MARGIN.left) / w * (x1 - x0));
      self.cursorGroup.forEach(function (p) { p.showCursor(step); });
      self.showTip(step, ev.clientX - self.root.getBoundingClientRect().left, ev.clientY - self.root.getBoundingClientRect().top);
    });
    overlay.addEventListener('mouseleave', function () {
      self.cursorGroup.forEach(function (p) { p.showCursor(null); });
      self.tip.hidden = true;
    });

    this.holder.textContent = '';
    this.holder.appendChild(svg);
  };

  Plot.prototype.showCursor = function (step) {
    if (!this.cursor) return;
    if (step === null) { this.cursor.setAttribute('visibility', 'hidden'); return; }
    var x = this.sx(step).toFixed(1);
    this.cursor.setAttribute('x1', x);
    this.cursor.setAttribute('x2', x);
    this.cursor.setAttribute('visibility', 'visible');
  };

  Plot.prototype.showTip = function (step, px, py) {
    var self = this, tip = this.tip;
    tip.textContent = '';
    tip.appendChild(el('div', null, 'step ' + step));
    this.spec.series.forEach(function (s) {
      if (self.hidden[s.name]) return;
      var i = nearest(s.x, step);
      if (i < 0 || Math.abs(s.x[i] - step) > Math.max(1, (self.x1 - self.x0) / self.w * 4)) return;
      var row = el('div');
      row.appendChild(el('span', 'k', s.name + ': '));
      row.appendChild(document.createTextNode(fmt(s.y[i]) + (s.x[i] !== step ? '  (step ' + s.x[i] + ')' : '')));
      tip.appendChild(row);
    });
    (this.run.skipped_ranges || []).forEach(function (r) { if (step >= r[0] && step <= r[1]) tip.appendChild(el('div', null, 'skipped')); });
    (this.run.rollback_marks || []).forEach(function (m) { if (m.step === step) tip.appendChild(el('div', null, 'rollback to step ' + m.to)); });
    tip.hidden = false;
    var left = px + 14;
    if (left + 220 > this.root.clientWidth) left = Math.max(0, px - 230);
    tip.style.left = left + 'px';
    tip.style.top = Math.max(0, py - 10) + 'px';
  };

  // ------------------------------------------------------------ sections
  function series(run, key, name, color, width) {
    var s = run.series[key];
    return { name: name, x: s.x, y: s.y.map(num), color: color, width: width };
  }

  function summaryTable(runs) {
    var card = el('section', 'card');
    card.id = 'summary';
    card.appendChild(el('h2', null, runs.length === 1 ? 'Summary' : 'Summary of ' + runs.length + ' runs'));
    var table = el('table', 'summary');
    var head = el('tr');
    ['run', 'status', 'steps', 'skipped', 'rollbacks', 'final loss', 'first non-finite'].forEach(function (h, i) {
      head.appendChild(el('th', i >= 2 && i <= 5 ? 'num' : null, h));
    });
    table.appendChild(el('thead')).appendChild(head);
    var body = el('tbody');
    runs.forEach(function (run, i) {
      var tr = el('tr');
      var td = el('td');
      var a = el('a', null, run.name);
      a.href = '#run-' + i;
      td.appendChild(a);
      tr.appendChild(td);
      var st = status(run);
      var sd = el('td');
      sd.appendChild(el('span', 'badge ' + st, st));
      sd.title = run.summary;
      tr.appendChild(sd);
      tr.appendChild(el('td', 'num', run.events));
      tr.appendChild(el('td', 'num', run.skipped));
      tr.appendChild(el('td', 'num', run.rollbacks));
      tr.appendChild(el('td', 'num', run.events ? fmt(run.final_loss) : '\u2014'));
      tr.appendChild(el('td', 'mono', run.first_problem || '\u2014'));
      body.appendChild(tr);
    });
    table.appendChild(body);
    card.appendChild(table);
    return card;
  }

  function timeline(run) {
    var frag = document.createDocumentFragment();
    frag.appendChild(el('h3', null, 'Events'));
    if (!run.timeline.length) {
      frag.appendChild(el('p', 'note', 'Every step was a plain optimizer step: no skips, rollbacks, spikes or notes.'));
      return frag;
    }
    var table = el('table', 'timeline');
    var head = el('tr');
    ['step', 'action', 'what happened'].forEach(function (h) { head.appendChild(el('th', null, h)); });
    table.appendChild(el('thead')).appendChild(head);
    var body = el('tbody');
    run.timeline.forEach(function (row) {
      var tr = el('tr');
      tr.appendChild(el('td', 'step num', row.step));
      var ad = el('td', 'action');
      ad.appendChild(el('span', 'badge ' + row.action, row.action));
      tr.appendChild(ad);
      var what = el('td');
      row.items.forEach(function (it) {
        var line = el('div', 'item');
        line.appendChild(el('span', 'kind kind-' + it[0], it[0]));
        line.appendChild(el('span', it[0] === 'finding' || it[0] === 'bundle' ? 'mono' : null, it[1]));
        what.appendChild(line);
      });
      if (!row.items.length && row.skipped) what.appendChild(el('div', 'item', 'step skipped'));
      tr.appendChild(what);
      body.appendChild(tr);
    });
    table.appendChild(body);
    frag.appendChild(table);
    if (run.timeline_omitted) frag.appendChild(el('p', 'note', run.timeline_omitted + ' more events not listed.'));
    return frag;
  }

  var STAT_COLUMNS = [
    ['numel', 'numel'], ['nan', 'NaN'], ['pos_inf', '+Inf'], ['neg_inf', '-Inf'], ['zeros', 'zeros'],
    ['subnormal', 'subnormal'], ['min', 'min'], ['max', 'max'], ['mean', 'mean'], ['std', 'std'],
    ['absmax', '|max|'], ['fp16_overflow', '>fp16 max'], ['first_nonfinite_index', 'first bad index']];

  function statsTable(f) {
    var table = el('table', 'stats');
    var head = el('tr');
    head.appendChild(el('th', null, 'tensor'));
    head.appendChild(el('th', null, 'dtype'));
    head.appendChild(el('th', null, 'shape'));
    STAT_COLUMNS.forEach(function (c) { head.appendChild(el('th', 'num', c[1])); });
    table.appendChild(el('thead')).appendChild(head);
    var body = el('tbody');
    (f.inputs || []).concat(f.outputs || []).forEach(function (r) {
      var tr = el('tr');
      tr.appendChild(el('td', 'mono', r.name));
      tr.appendChild(el('td', null, r.dtype));
      tr.appendChild(el('td', 'mono', '[' + (r.shape || []).join(', ') + ']'));
      STAT_COLUMNS.forEach(function (c) {
        var v = r.stats ? r.stats[c[0]] : undefined;
        var text = v === undefined ? '' : (c[0] === 'first_nonfinite_index' && v < 0 ? '\u2014' : fmt(v));
        var bad = (c[0] === 'nan' || c[0] === 'pos_inf' || c[0] === 'neg_inf' || c[0] === 'fp16_overflow') && num(v) > 0;
        tr.appendChild(el('td', 'num' + (bad ? ' bad' : ''), text));
      });
      body.appendChild(tr);
    });
    table.appendChild(body);
    return table;
  }

  // The finding's likely cause, its evidence and the remedy (diagnosis.h).
  function diagnosisBlock(d) {
    var box = el('div', 'diagnosis');
    [['cause', d.cause + ' (' + d.confidence + ' confidence)'], ['evidence', d.evidence],
      ['remedy', d.remedy]].forEach(function (row) {
      var p = el('p', row[0]);
      p.appendChild(el('span', 'k', row[0]));
      p.appendChild(el('span', null, row[1]));
      box.appendChild(p);
    });
    return box;
  }

  // The remedies the guard tried on replays of the step (remedy_check.h): a
  // line each with its result, what it applied, the replayed loss and the
  // detail; the first that kept the step finite is the verified one.
  var CHECK_RESULTS = {finite: 'finite', still_nonfinite: 'still non-finite', not_checkable: 'not checkable'};

  function remedyChecksBlock(checks) {
    var box = el('div', 'remedy-checks');
    var verified = false;
    checks.forEach(function (c) {
      var first = c.result === 'finite' && !verified;
      verified = verified || first;
      var p = el('p', 'check ' + c.result + (first ? ' verified' : ''));
      p.appendChild(el('span', 'k', first ? 'verified' : 'tried'));
      p.appendChild(el('span', 'result', CHECK_RESULTS[c.result] || c.result));
      var text = ': ' + (c.applied || c.remedy);
      if (!isNaN(num(c.loss))) text += ' (replayed loss ' + fmt(c.loss) + ')';
      if (c.detail) text += '; ' + c.detail;
      p.appendChild(el('span', null, text));
      box.appendChild(p);
    });
    return box;
  }

  function findingCard(f) {
    var card = el('div', 'finding ' + f.role);
    card.setAttribute('data-op', f.op);
    var title = 'step ' + f.step + ' \u00B7 ' + f.direction + ' \u00B7 ' + f.op + (f.module ? ' in ' + f.module : '') +
      ' \u00B7 ' + f.role;
    // The same failure at several steps is one card.
    if (f.count > 1) {
      title += ' \u00B7 \u00D7' + f.count + ' at steps ' + f.steps.join(', ') + (f.count > f.steps.length ? ', \u2026' : '');
      card.setAttribute('data-count', f.count);
    }
    card.appendChild(el('div', 'finding-title', title));
    if (f.diagnosis) card.appendChild(diagnosisBlock(f.diagnosis));
    if ((f.remedy_checks || []).length) card.appendChild(remedyChecksBlock(f.remedy_checks));
    var kv = el('div', 'kv');
    var fields = [['op', f.op], ['module', f.module || '(unknown)'], ['direction', f.direction], ['role', f.role],
      ['step', f.step]];
    if (f.node) fields.push(['node', f.node]);
    if (f.forward_op) fields.push(['forward op', f.forward_op]);
    if (f.caller) fields.push(['inside', f.caller]);
    if (f.culprit) fields.push(['culprit', f.culprit]);
    if (f.rank >= 0) fields.push(['rank', f.rank]);
    fields.push(['output', f.output], ['element index', f.index], ['value', fmt(f.value)]);
    if (f.sequence_nr >= 0) fields.push(['sequence nr', f.sequence_nr]);
    fields.forEach(function (kvp) {
      var d = el('div');
      d.appendChild(el('span', 'k', kvp[0]));
      d.appendChild(el('span', 'mono', kvp[1]));
      d.title = kvp[0] + ': ' + kvp[1];
      kv.appendChild(d);
    });
    card.appendChild(kv);
    if ((f.inputs || []).length + (f.outputs || []).length) card.appendChild(statsTable(f));
    if (f.backtrace) {
      var det = el('details');
      det.appendChild(el('summary', null, 'C++ call site'));
      det.appendChild(el('pre', null, f.backtrace));
      card.appendChild(det);
    }
    return card;
  }

  function runSection(run, index) {
    var card = el('section', 'card run');
    card.id = 'run-' + index;
    var head = el('div', 'run-header');
    head.appendChild(el('h2', null, run.name));
    var st = status(run);
    head.appendChild(el('span', 'badge ' + st, st));
    card.appendChild(head);
    var plots = 0;
    if (!run.events) {
      card.appendChild(el('p', 'note', 'No training steps logged.'));
      if ((run.timeline || []).length) card.appendChild(timeline(run));  // the data firewall's events
      return { node: card, plots: 0 };
    }
    card.appendChild(el('p', 'run-summary', run.summary));
    var chips = el('div', 'chips');
    [['steps', run.first_step + '\u2013' + run.last_step], ['events', run.events], ['skipped', run.skipped],
      ['rollbacks', run.rollbacks], ['final loss', fmt(run.final_loss)]].forEach(function (c) {
      var s = el('span', null, c[0] + ' ');
      s.appendChild(el('b', null, c[1]));
      chips.appendChild(s);
    });
    card.appendChild(chips);
    var downsampled = run.series.loss.points > run.series.loss.x.length;
    if (downsampled)
      card.appendChild(el('p', 'note', 'Plots show ' + run.series.loss.x.length + ' of ' + run.series.loss.points +
        ' steps: the smallest and largest value of each stretch, and every skipped or non-finite step.'));

    var group = [];
    var norms = [series(run, 'grad_norm', 'global', '#1d2330', 2)];
    run.param_norms.forEach(function (p, i) {
      norms.push({ name: p.name, x: p.x, y: p.y.map(num), color: PALETTE[i % PALETTE.length], width: 1.2 });
    });
    var specs = [
      { id: 'loss', title: 'Loss', series: [series(run, 'loss', 'loss', PALETTE[0])] },
      { id: 'grad_norm', title: 'Gradient norm (before clipping)' + (run.param_norms.length ? ': global and largest per parameter' : ''),
        series: norms },
      { id: 'scale', title: 'Loss scale', series: [series(run, 'scale', 'scale', PALETTE[2])] },
      { id: 'lr', title: 'Learning rate', series: [series(run, 'lr', 'lr', PALETTE[3])] }];
    specs.forEach(function (spec) {
      new Plot(card, spec, run, group);
      ++plots;
    });
    if (run.param_norms_omitted)
      card.appendChild(el('p', 'note', run.param_norms_omitted + ' more parameters were among the largest norms at some step (not drawn).'));
    var legend = el('p', 'note', 'Shaded: skipped steps. Dashed: rollbacks. Solid red: abort. ' +
      'Red markers at the edge: NaN / Inf values.');
    card.appendChild(legend);

    card.appendChild(timeline(run));
    var seen = run.findings.reduce(function (n, f) { return n + (f.count || 1); }, 0);
    card.appendChild(el('h3', null, 'Findings' + (run.findings.length ? ' (' + (run.findings.length + run.findings_omitted) +
      (seen > run.findings.length ? ', seen ' + seen + ' times' : '') + ')' : '')));
    if (!run.findings.length) {
      card.appendChild(el('p', 'note', run.first_problem ? 'Non-finite values were seen but not traced to an op.'
        : 'No non-finite value was traced.'));
    }
    run.findings.forEach(function (f) { card.appendChild(findingCard(f)); });
    if (run.findings_omitted) card.appendChild(el('p', 'note', run.findings_omitted + ' more distinct findings not shown.'));
    return { node: card, plots: plots };
  }

  function render() {
    var data = JSON.parse(document.getElementById('nanguard-data').textContent);
    var main = document.getElementById('report');
    main.textContent = '';
    document.getElementById('meta').textContent = 'nanguard ' + data.version + ' \u00B7 ' + data.runs.length +
      (data.runs.length === 1 ? ' run' : ' runs');
    main.appendChild(summaryTable(data.runs));
    var plots = 0;
    data.runs.forEach(function (run, i) {
      var section = runSection(run, i);
      main.appendChild(section.node);
      plots += section.plots;
    });
    // Draw again now that the sections are in the page and have their width.
    document.querySelectorAll('.plot').forEach(function (p) { if (p.plot) p.plot.draw(); });
    var resizeTimer = null;
    window.addEventListener('resize', function () {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(function () {
        document.querySelectorAll('.plot').forEach(function (p) { if (p.plot) p.plot.draw(); });
      }, 150);
    });
    // The sections exist only now: honour a #run-N in the address.
    var target = location.hash && document.getElementById(location.hash.slice(1));
    if (target) target.scrollIntoView();
    document.body.setAttribute('data-runs', String(data.runs.length));
    document.body.setAttribute('data-rendered', String(plots));
  }

  try {
    render();
  } catch (e) {
    if (window.nanguardRecordError) window.nanguardRecordError('render failed: ' + (e && e.stack ? e.stack : e));
    else throw e;
  }
})();
