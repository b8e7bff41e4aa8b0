(function () {
  "use strict";
  var meta = JSON.parse(document.getElementById("kvwatch-meta").textContent);
  var data = JSON.parse(document.getElementById("kvwatch-state").textContent);
  var body = document.body;
  var every = Number(body.getAttribute("data-refresh-seconds")) * 1000;
  var updates = 0, selected = null, sortKey = "worst", sortDir = 1;
  var SVGNS = "http://www.w3.org/2000/svg";
  var SEV = {critical: 0, warning: 1, info: 2};
  var STATE_RANK = {bad: 3, warn: 2, ok: 1, none: 0};

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function svg(tag, attrs) {
    var node = document.createElementNS(SVGNS, tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    return node;
  }
  function add(parent) {
    for (var i = 1; i < arguments.length; i++) if (arguments[i]) parent.appendChild(arguments[i]);
    return parent;
  }
  function swap(id, node) { node.id = id; document.getElementById(id).replaceWith(node); }
  function labelKey(key) {
    var q = Number(key);
    return (key !== "" && q > 0 && q < 1) ? "p" + Number((q * 100).toFixed(6)) : key;
  }
  function fmt(value, unit) {
    if (value === null || value === undefined) return "\u2013";
    if (typeof value === "object") {
      var parts = Object.keys(value).map(function (k) { return labelKey(k) + " " + fmt(value[k], unit); });
      return parts.length ? parts.join(", ") : "\u2013";
    }
    if (typeof value !== "number") return String(value);
    if (!isFinite(value)) return "\u2013";
    if (unit === "ratio") return (value * 100).toFixed(1) + "%";
    if (unit === "seconds") {
      if (Math.abs(value) >= 1) return value.toFixed(2) + " s";
      if (Math.abs(value) >= 0.001 || value === 0) return three(value * 1000) + " ms";
      return three(value * 1e6) + " \u00b5s";
    }
    if (unit === "tokens" || unit === "bytes") return (Math.round(value) || 0).toLocaleString("en-US");
    if (unit === "per_second") return three(value) + "/s";
    if (Number.isInteger(value)) return String(value);
    return three(value);
  }
  // Three significant digits, never in exponent notation (statuspage._three).
  function three(value) {
    var rounded = Number(value.toPrecision(3));
    if (rounded === 0) return "0";
    var text = rounded.toFixed(Math.max(0, 2 - Math.floor(Math.log10(Math.abs(rounded)))));
    return text.indexOf(".") >= 0 ? text.replace(/0+$/, "").replace(/\.$/, "") : text;
  }
  function clock(seconds) { return seconds ? new Date(seconds * 1000).toTimeString().slice(0, 8) : "never"; }
  function minutes(seconds) { return new Date(seconds * 1000).toTimeString().slice(0, 5); }
  // "since 14:02, 6 min ago": when a finding was first seen, against the latest poll.
  // A held finding (diagnosis: finding_hold_seconds) says it is clearing, and when it ends unless it returns.
  function sinceText(f, now, hold) {
    var text = f.since ? "since " + minutes(f.since) + ", " + span(Math.max(0, (now || f.since) - f.since)) + " ago"
      : "active now";
    if (!f.clearing_since) return text;
    return text + " \u00b7 clearing: " + endedText(f) +
      (hold ? " \u00b7 gone at " + clock(f.clearing_since + hold) + " unless it returns" : "");
  }
  // A finding whose condition stopped: when, and its peak (the figure leading its card, as last seen).
  function endedText(f) {
    var peak = ((meta.deciding || {})[f.cause] || []).filter(function (key) {
      var v = (f.evidence || {})[key];
      return v !== null && v !== undefined;
    })[0];
    return "ended at " + clock(f.clearing_since) + (peak ? ", peak " + evidenceLabel(peak) + " " + evidenceText(f, peak) : "");
  }
  function where(f) { return f.model_name + (f.engine !== null && f.engine !== undefined ? " / " + f.engine : ""); }
  // The runbook section: a link (kvwatch serves the runbooks at runbooks#<section>).
  function runbookNode(f) {
    if (!f.runbook) return null;
    var p = el("p", "runbook");
    p.setAttribute("data-runbook", f.runbook);
    p.appendChild(el("b", null, "Runbook: "));
    if (/^(https?:\/\/|runbooks#|\/runbooks#)/.test(f.runbook)) {
      var a = el("a", null, f.runbook);
      a.href = f.runbook;
      a.rel = "noopener";
      p.appendChild(a);
    } else p.appendChild(el("code", null, f.runbook));
    return p;
  }
  function span(seconds) {
    seconds = Math.max(0, Math.round(seconds));
    if (seconds < 90) return seconds + " s";
    if (seconds < 5400) return Math.round(seconds / 60) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }
  function keyOf(row) { return row.model_name + " / " + row.engine; }
  // A finding that cannot be told from another cause says so in its title, not only below it:
  // the headline never claims more than its evidence (diagnose/arbitration.py, alternatives).
  function title(f) {
    var alts = (f.alternatives || []).map(function (a) { return meta.causes[a.cause] || a.cause; });
    // A finding a source decided says so (arbitration.DECIDED_HEADLINE, as the noscript page and the CLI).
    var decided = (meta.decided || {})[(f.evidence || {}).decided_by];
    return (meta.symptoms[f.symptom] || f.symptom) + ": " + (meta.causes[f.cause] || f.cause) +
      (alts.length ? ", or " + alts.join(", or ") : "") + (decided ? " (" + decided + ")" : "");
  }
  // A quantile pinned at a bucket edge is a bound: "< 300 ms", "> 80 s"
  // (the row's `pinned`: {signal: {quantile: "<" | ">"}}).
  function pinnedBound(row, signal, quantile) {
    var bounds = (row.pinned || {})[signal] || {};
    return bounds[quantile] === "<" || bounds[quantile] === ">" ? bounds[quantile] : null;
  }
  function bounded(text, bound) { return bound ? bound + " " + text : text; }
  function figureValue(fig, row) {
    var v = row.signals[fig.signal];
    if (fig.quantile) v = v ? v[fig.quantile] : null;
    return (v === undefined) ? null : v;
  }
  function compare(value, rule, thresholds) {
    var limit = rule.threshold ? thresholds[rule.threshold] : rule.value;
    if (value === null || limit === null || limit === undefined) return false;
    if (rule.op === ">=") return value >= limit;
    if (rule.op === ">") return value > limit;
    if (rule.op === "<") return value < limit;
    return value <= limit;
  }
  function findingsFor(row, findings) {
    return findings.filter(function (f) { return f.model_name === row.model_name && (f.engine === row.engine || f.engine === null); });
  }
  // The state of every figure of one engine: its threshold, raised by an active finding of its symptom.
  function figureStates(row, findings, thresholds) {
    var states = {};
    meta.figures.forEach(function (fig) {
      if (fig.same_as) return;
      var value = figureValue(fig, row);
      var state = value === null ? "none" : "ok";
      for (var i = 0; i < fig.rules.length; i++) {
        if (compare(value, fig.rules[i], thresholds)) { state = fig.rules[i].state; break; }
      }
      // A finding deepens the colour of a figure its own threshold already marks, never of a
      // calm one: "Waiting 0" or "KV usage 0.0%" is not red because exhaustion was diagnosed.
      var own = state;
      findings.forEach(function (f) {
        if (fig.symptoms.indexOf(f.symptom) < 0 || f.severity === "info") return;
        if (own !== "warn" && own !== "bad") return;
        var raised = f.severity === "critical" ? "bad" : "warn";
        if (STATE_RANK[raised] > STATE_RANK[state]) state = raised;
      });
      states[fig.key] = state;
    });
    meta.figures.forEach(function (fig) { if (fig.same_as) states[fig.key] = states[fig.same_as]; });
    return states;
  }
  function figureText(fig, row) {
    var value = figureValue(fig, row);
    var text = fmt(value, meta.units[fig.signal]);
    if (fig.quantile && value !== null) text = bounded(text, pinnedBound(row, fig.signal, fig.quantile));
    return text;
  }
  function worstRank(row, findings) {
    var mine = findingsFor(row, findings);
    return mine.length ? Math.min.apply(null, mine.map(function (f) { return SEV[f.severity]; })) : 3;
  }
  function enginesWorstFirst(signals, diagnosis) {
    var findings = diagnosis.findings || [];
    return (signals.engines || []).slice().sort(function (a, b) {
      var d = worstRank(a, findings) - worstRank(b, findings);
      if (d) return d;
      var ua = a.signals.kvwatch_kv_cache_usage_ratio || 0, ub = b.signals.kvwatch_kv_cache_usage_ratio || 0;
      return ub - ua || keyOf(a).localeCompare(keyOf(b));
    });
  }

  // "22 of 60 s" while the window fills; once full, the span the figures cover (it holds
  // one poll at or before its start, so it spans a little more than set: not "62 of 60 s").
  function windowText(signals) {
    var covered = Math.round(signals.window_covered_seconds || 0), set = Math.round(signals.window_seconds);
    return covered < set ? covered + " of " + set + " s" : covered + " s";
  }
  // A replay (kvwatch serve --replay) is marked, with recorded times: it must never read as live.
  function renderStatus(signals) {
    var p = el("p", "muted"), replay = signals.replay;
    if (replay) {
      var mark = el("span", "pill " + (replay.finished ? "info" : "warning"), replay.finished ? "replay ended" : "replay");
      mark.setAttribute("data-replay", replay.finished ? "finished" : "running");
      add(p, mark, document.createTextNode(replay.text + " \u00b7 "));
    }
    add(p, document.createTextNode("Target "), el("code", null, signals.target || ""),
      document.createTextNode(" \u00b7 " + (signals.busy ? "busy" : signals.up ? "up" : "down") + " \u00b7 " + signals.polls +
        " polls \u00b7 window " + windowText(signals) + " \u00b7 " + (replay ? "recorded time " : "last poll ") +
        clock(signals.last_success_time)));
    if (signals.engine_spelling) {
      var spelled = el("code", null, signals.engine_spelling);
      spelled.setAttribute("data-spelling", signals.engine_spelling);
      add(p, document.createTextNode(" \u00b7 names spelled "), spelled);
    }
    if (signals.window_trimmed) add(p, document.createTextNode(" \u00b7 " + signals.window_trimmed));
    swap("status", p);
  }
  function liveText(signals) {
    var replay = signals.replay;
    if (replay && replay.finished) return "Replay ended: the page shows the recording's last state (recorded " +
      clock(signals.last_success_time) + "); nothing new will come.";
    return (replay ? "Replay: refreshed " : "Live: refreshed ") + clock(Date.now() / 1000) + ", every " + (every / 1000) + " s.";
  }

  // Why, in the sidecar's one sentence per failure (kvwatch.scrape.SENTENCES: the JSON's
  // `detail`, which /readyz and the CLI print too).
  function downSentence(signals) {
    var why = signals.detail || "the poll failed (" + (signals.reason || "") + ")";
    var last = signals.last_success_time ? "The last good poll was at " + clock(signals.last_success_time) + "." :
      "No poll has succeeded yet.";
    return "kvwatch cannot read the engine's metrics at " + (signals.target || "its target") + ": " + why + ". " + last;
  }

  // The demo's phase strip (demo_target, set by make run): the simulated phase now, the next and when.
  function clockText(seconds) {
    var whole = Math.max(0, Math.round(seconds)), h = Math.floor(whole / 3600), m = Math.floor(whole % 3600 / 60),
      s = whole % 60, two = function (n) { return (n < 10 ? "0" : "") + n; };
    return h ? h + ":" + two(m) + ":" + two(s) : m + ":" + two(s);
  }
  var countdownFrom = null;
  window.setInterval(function () {
    if (countdownFrom && countdownFrom.node.isConnected) countdownFrom.node.textContent =
      clockText(Math.max(0, countdownFrom.seconds - (Date.now() - countdownFrom.at) / 1000));
  }, 1000);
  function renderPhase(signals) {
    var node = el("div"), d = signals.demo;
    countdownFrom = null;
    if (d !== undefined) {
      node.className = "phase-strip";
      node.appendChild(el("b", null, "Demo:"));
      if (!d) node.appendChild(document.createTextNode(" the simulator's phase is unknown (its /sim/phase did not answer)."));
      else {
        node.setAttribute("data-phase", d.phase);
        node.setAttribute("data-next", d.next || "");
        add(node, document.createTextNode(" now: "), el("span", "now", d.phase),
          d.note ? document.createTextNode(" (" + d.note + ")") : null);
        if (d.next && d.next_in_seconds !== null) {
          var countdown = el("span", "countdown", clockText(d.next_in_seconds));
          add(node, document.createTextNode(" \u00b7 next: "), el("span", "next", d.next),
            document.createTextNode(" in "), countdown, document.createTextNode(d.clock === "simulated" ? " (simulated)" : ""));
          // In wall time the countdown runs between refreshes (from when this data arrived).
          if (d.clock === "wall") countdownFrom = {node: countdown, seconds: d.next_in_seconds, at: Date.now()};
        }
        if (d.cycle_seconds) node.appendChild(document.createTextNode(" \u00b7 a loop of " + (d.phases || "its") +
          " phases takes " + clockText(d.cycle_seconds) + (d.speed ? " at speed " + d.speed : "") +
          " (SPEED=N make run runs it N times faster)"));
      }
    }
    swap("phase", node);
  }

  function renderBanner(signals, diagnosis) {
    var div = el("div", "banner");
    var findings = diagnosis.findings || [];
    if (signals.busy && (!signals.up || !findings.length)) {
      // Busy, not down: /metrics late or timed out under load (Monitor._busy), the lateness measured.
      div.className += " sev-warning";
      div.setAttribute("data-state", "busy");
      add(div, add(el("div", "head"), el("span", "pill warning", "busy"),
        document.createTextNode(signals.up ? "Engine busy: its metrics come late" : "Engine busy, not down")),
        el("p", null, signals.busy.sentence + " (busy since " + clock(signals.busy.since) + ")."));
    } else if (!signals.up) {
      div.className += " sev-down";
      div.setAttribute("data-state", "down");
      add(div, add(el("div", "head"), el("span", "pill critical", "down"), document.createTextNode("Engine not read")),
        el("p", null, downSentence(signals)));
    } else if (!findings.length) {
      div.className += " sev-ok";
      div.setAttribute("data-state", "ok");
      var n = (signals.engines || []).length;
      add(div, add(el("div", "head"), el("span", "pill ok", "ok"), document.createTextNode("No active findings")),
        el("p", null, "Nothing in the last " + span(signals.window_covered_seconds || 0) + " on " + n +
          (n === 1 ? " engine" : " engines") + " crossed a threshold of the diagnosis."));
    } else {
      // The worst active finding; one held while clearing only when nothing else is active
      // (findings come active first, most severe first: diagnose.vocabulary.finding_order).
      var active = findings.filter(function (x) { return !x.clearing_since; });
      var f = active.length ? active[0] : findings[0];
      // Cards below besides this one (a finding told as this one's cause is in it).
      var others = findings.filter(function (x) { return x !== f && !(f.caused_by && x.cause_of); }).length;
      div.className += " sev-" + f.severity + (f.clearing_since ? " clearing" : "");
      div.setAttribute("data-state", f.severity);
      if (f.clearing_since) div.setAttribute("data-clearing", "true");
      div.setAttribute("data-symptom", f.symptom);
      div.setAttribute("data-cause", f.cause);
      var since = el("span", "since", sinceText(f, signals.last_success_time, (signals.thresholds || {}).finding_hold_seconds));
      add(div, add(el("div", "head"), el("span", "pill " + f.severity, f.severity), document.createTextNode(title(f))),
        add(el("p"), document.createTextNode(where(f) + " \u00b7 "), since, document.createTextNode(" \u00b7 " + f.confidence + " confidence" +
          (others ? " \u00b7 " + others + " more finding" + (others > 1 ? "s" : "") + " below" : ""))),
        el("p", null, f.summary), add(el("p"), el("b", null, "Next: "), document.createTextNode(meta.actions[f.cause] || f.next_check)));
      if (f.caused_by) div.appendChild(becauseNode(f.caused_by));
    }
    swap("banner", div);
  }

  // Values the engine reported that cannot be true (kvwatch.engines.plausible): a fault of its metrics, left out.
  function renderFaults(signals) {
    var faults = signals.source_faults || [], div = el("div");
    if (faults.length) {
      div.className = "banner sev-warning";
      div.setAttribute("data-state", "source-fault");
      add(div, add(el("div", "head"), el("span", "pill warning", "source fault"),
        document.createTextNode(faults.length + (faults.length === 1 ? " value" : " values") +
          " from the engine cannot be true")));
      faults.forEach(function (f) {
        var p = el("p", null, f.sentence);
        p.setAttribute("data-fault", f.fault);
        p.setAttribute("data-family", f.family);
        div.appendChild(p);
      });
    }
    swap("faults", div);
  }

  function renderFigures(row, signals, diagnosis) {
    var section = el("section");
    if (!row) {
      section.appendChild(el("p", "muted", signals.up ? "No engine data yet." : ""));
      swap("figures", section);
      return;
    }
    var findings = findingsFor(row, diagnosis.findings || []);
    var states = figureStates(row, findings, signals.thresholds || {});
    section.appendChild(el("h2", null, "Now on " + keyOf(row)));
    var grid = el("div", "figures");
    meta.figures.forEach(function (fig) {
      var box = el("div", "fig state-" + states[fig.key]);
      box.setAttribute("data-figure", fig.key);
      box.setAttribute("data-state", states[fig.key]);
      add(box, el("div", "label", fig.label), el("div", "value", figureText(fig, row)));
      if (fig.sub) {
        var subValue = row.signals[fig.sub];
        if (subValue !== null && subValue !== undefined) box.appendChild(el("div", "sub", fig.sub_label + " " + fmt(subValue, meta.units[fig.sub])));
      }
      // This engine's version counts the figure's counter differently: said below the figures.
      if ((row.caveats || {})[fig.signal]) {
        box.setAttribute("data-caveat", fig.signal);
        box.appendChild(el("div", "sub caveat", "counted differently by this version (below)"));
      }
      grid.appendChild(box);
    });
    section.appendChild(grid);
    Object.keys(row.caveats || {}).forEach(function (signal) {
      var p = add(el("p", "note caveat"), el("b", null, (meta.labels[signal] || signal) + ": "),
                  document.createTextNode(row.caveats[signal]));
      p.setAttribute("data-caveat", signal);
      section.appendChild(p);
    });
    // Which figures are the last poll's and which span the window: the trends below end
    // on shorter spans, so a p95 or a ratio differs there and must not look like an error.
    var over = function (kind) {
      return meta.figures.filter(function (f) { return f.over === kind; }).map(function (f) { return f.short; }).join(", ");
    };
    section.appendChild(el("p", "muted span-note", over("poll") + ": the last poll; " + over("window") +
      ": over the last " + span(signals.window_covered_seconds || 0) + "."));
    // Every cache tier in one view: the window's prompt tokens by the tier that served them, and computed.
    var tiers = row.signals.kvwatch_prompt_tokens_by_tier_ratio;
    if (tiers) {
      var p = el("p", "tiers", meta.labels.kvwatch_prompt_tokens_by_tier_ratio + ": " + fmt(tiers, "ratio"));
      p.setAttribute("data-tiers", Object.keys(tiers).join(" "));
      section.appendChild(p);
    }
    swap("figures", section);
  }

  function renderEngines(signals, diagnosis, rows) {
    var section = el("section");
    if (rows.length < 2) { swap("engines", section); return; }
    var findings = diagnosis.findings || [];
    section.appendChild(el("h2", null, "Engines (" + rows.length + "), worst first; click a row for its detail"));
    var columns = [{key: "worst", label: "Engine"}, {key: "finding", label: "Worst finding", cls: "wide"}]
      .concat(meta.figures.map(function (fig) { return {key: fig.key, label: fig.short, fig: fig, cls: fig.wide ? "num wide" : "num"}; }));
    var ordered = rows.slice();
    if (sortKey !== "worst") {
      var fig = meta.figures.filter(function (f) { return f.key === sortKey; })[0];
      ordered.sort(function (a, b) {
        var va = fig ? figureValue(fig, a) : null, vb = fig ? figureValue(fig, b) : null;
        if (sortKey === "finding") { va = worstRank(a, findings); vb = worstRank(b, findings); }
        va = va === null ? -Infinity : va; vb = vb === null ? -Infinity : vb;
        return (va < vb ? 1 : va > vb ? -1 : 0) * sortDir;
      });
    } else if (sortDir < 0) ordered.reverse();
    var table = el("table"), thead = el("thead"), head = el("tr");
    columns.forEach(function (c) {
      var th = el("th", c.cls || null, c.label + (sortKey === c.key ? (sortDir > 0 ? " \u25be" : " \u25b4") : ""));
      th.setAttribute("data-sort", c.key);
      th.addEventListener("click", function () {
        sortDir = sortKey === c.key ? -sortDir : 1;
        sortKey = c.key;
        render();
      });
      head.appendChild(th);
    });
    add(table, add(thead, head));
    var tbody = el("tbody");
    ordered.forEach(function (row) {
      var mine = findingsFor(row, findings);
      var states = figureStates(row, mine, signals.thresholds || {});
      var tr = el("tr", keyOf(row) === selected ? "selected" : null);
      tr.setAttribute("data-engine", keyOf(row));
      var worst = mine[0];
      var name = el("td");
      add(name, el("span", "pill " + (worst ? worst.severity : "ok"), worst ? worst.severity : "ok"), document.createTextNode(keyOf(row)));
      add(tr, name, el("td", "wide", worst ? title(worst) : "\u2013"));
      meta.figures.forEach(function (fig) {
        var td = el("td", (fig.wide ? "num wide" : "num") + " state-" + states[fig.key], figureText(fig, row));
        td.setAttribute("data-figure", fig.key);
        tr.appendChild(td);
      });
      tr.addEventListener("click", function () { selected = keyOf(row); render(); });
      tbody.appendChild(tr);
    });
    add(section, add(el("div", "scroll"), add(table, tbody)));
    swap("engines", section);
  }

  function chart(spec, series, times, markers, thresholds) {
    var box = el("div", "chart");
    box.setAttribute("data-series", spec.series);
    var W = 300, H = 72, n = times.length;
    var t0 = n ? times[0] : 0, t1 = n ? times[n - 1] : 1;
    var x = function (t) { return t1 > t0 ? (t - t0) / (t1 - t0) * W : W; };
    var values = spec.stack ? null : (series[spec.series] || []);
    var top = spec.max || 0;
    if (!spec.stack) values.forEach(function (v) { if (v !== null && v > top) top = v; });
    var limit = spec.threshold ? thresholds[spec.threshold] : null;
    if (!spec.max && limit && limit > top) top = limit;
    if (!top) top = 1;
    var y = function (v) { return H - 2 - (v / top) * (H - 4); };
    var g = svg("svg", {viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "none", role: "img",
      "aria-label": spec.title, "data-points": String(n)});
    var latest = null;
    if (spec.stack) {
      var lower = times.map(function () { return 0; });
      spec.stack.forEach(function (name, k) {
        var vals = series[name] || [];
        var upper = lower.map(function (l, i) { return vals[i] === null || vals[i] === undefined ? null : l + vals[i]; });
        var top_ = [], bottom = [];
        for (var i = 0; i < n; i++) if (upper[i] !== null) { top_.push(x(times[i]) + "," + y(upper[i])); bottom.unshift(x(times[i]) + "," + y(lower[i])); }
        if (top_.length) g.appendChild(svg("polygon", {"class": "band" + k, points: top_.concat(bottom).join(" ")}));
        lower = upper.map(function (u, i) { return u === null ? lower[i] : u; });
      });
      var lastShares = spec.stack.map(function (name) { var s = series[name] || []; return s.length ? s[s.length - 1] : null; });
      latest = lastShares[0] === null || lastShares[0] === undefined ? "\u2013" : lastShares.map(function (v) { return fmt(v, "ratio"); }).join(" / ");
    } else {
      var seg = [];
      var flush = function () { if (seg.length) g.appendChild(svg("polyline", {"class": "line", points: seg.join(" ")})); seg = []; };
      for (var i = 0; i < n; i++) {
        var v = values[i];
        if (v === null || v === undefined) { flush(); continue; }
        seg.push(x(times[i]).toFixed(1) + "," + y(v).toFixed(1));
      }
      flush();
      var lastIndex = values.length - 1;
      while (lastIndex >= 0 && (values[lastIndex] === null || values[lastIndex] === undefined)) lastIndex--;
      latest = lastIndex >= 0 ? fmt(values[lastIndex], spec.unit) : "\u2013";
      if (lastIndex >= 0 && spec.series === "ttft_p95" && series.ttft_p95_pinned && series.ttft_p95_pinned[lastIndex])
        latest = bounded(latest, series.ttft_p95_pinned[lastIndex]);
      if (limit !== null && limit !== undefined && limit <= top)
        g.appendChild(svg("line", {"class": "thr", x1: 0, x2: W, y1: y(limit), y2: y(limit)}));
    }
    markers.forEach(function (m) {
      // A finding first seen before the charted span has been active all along: marked at its start.
      var at = m.kind === "finding" ? Math.max(m.time, t0) : m.time;
      if (!n || at < t0 || at > t1) return;
      var line = svg("line", {"class": "mark " + (m.kind === "change" ? "change" : m.severity), x1: x(at), x2: x(at), y1: 0, y2: H});
      line.setAttribute("data-kind", m.kind);
      line.setAttribute("data-time", String(m.time));
      var tip = svg("title");
      tip.textContent = clock(m.time) + " " + (m.kind === "change" ? m.change + ": " : (meta.causes[m.cause] || m.cause) + ": ") + m.text;
      line.appendChild(tip);
      g.appendChild(line);
    });
    add(box, add(el("div", "title"), el("span", null, spec.title), el("span", "now", latest)), g);
    if (spec.stack) {
      var legend = el("div", "legend axis");
      add(legend, add(el("span"), el("span", "k0", "\u25a0 queue"), el("span", "k1", " \u25a0 prefill"), el("span", "k2", " \u25a0 other")));
      box.appendChild(legend);
    }
    add(box, add(el("div", "axis"), el("span", null, n ? "\u2212" + span(t1 - t0) : ""),
      el("span", null, limit !== null && limit !== undefined ? "threshold " + fmt(limit, spec.unit) : ""), el("span", null, "now")));
    return box;
  }

  function renderTrends(row, series) {
    var section = el("section");
    var line = row ? (series.engines || []).filter(function (e) { return e.model_name === row.model_name && e.engine === row.engine; })[0] : null;
    if (!line) { swap("trends", section); return; }
    var markers = (series.markers || []).filter(function (m) {
      return (m.model_name === null || m.model_name === row.model_name) && (m.engine === null || m.engine === row.engine);
    });
    section.appendChild(el("h2", null, "Trends over the window on " + keyOf(row) + " (each point over the " +
      series.trend_seconds + " s before it; marks: findings and changes)"));
    var grid = el("div", "charts");
    meta.trends.forEach(function (spec) { grid.appendChild(chart(spec, line, series.times || [], markers, data.signals.thresholds || {})); });
    section.appendChild(grid);
    swap("trends", section);
  }

  function evidenceUnit(key) {
    if (/seconds/.test(key)) return "seconds";
    if (/(ratio|share|usage)/.test(key) && !/tokens/.test(key)) return "ratio";
    if (/tokens/.test(key)) return "tokens";
    return "";
  }
  function evidenceLabel(key) {
    return key.replace(/_seconds$/, "").replace(/_/g, " ").replace(/\bkv\b/g, "KV").replace(/\bttft\b/g, "TTFT")
      .replace(/^./, function (c) { return c.toUpperCase(); });
  }
  function evidenceText(f, key) {
    var value = (f.evidence || {})[key];
    if (typeof value !== "number") return fmt(value, "");
    return bounded(fmt(value, evidenceUnit(key)), (f.pinned || {})[key]);
  }

  // The finding a card's finding is caused by (late first tokens because the cache is exhausted,
  // kvwatch.diagnose.arbitration.caused_by): its headline, its words and its next action, in the card.
  function becauseNode(c) {
    var div = el("div", "because");
    div.setAttribute("data-caused-by", c.symptom + "/" + c.cause);
    add(div, add(el("p"), el("b", null, "Because: "), el("span", "pill " + c.severity, c.severity),
      document.createTextNode(" " + title(c) + " \u00b7 " + c.confidence + " confidence")),
      el("p", null, c.summary),
      add(el("p"), el("b", null, "Next: "), document.createTextNode(meta.actions[c.cause] || c.next_check)), runbookNode(c));
    return div;
  }

  function renderFindings(signals, diagnosis) {
    var section = el("section");
    var findings = diagnosis.findings || [];
    section.appendChild(el("h2", null, "Findings (" + findings.length + " active)"));
    if (!findings.length) {
      section.appendChild(el("p", "muted", signals.up ? "No active findings." : "No findings while the engine is not polled."));
      swap("findings", section);
      return;
    }
    var grid = el("div", "cards"), opened = {};
    // A refresh redraws the cards: what the reader unfolded stays unfolded.
    Array.prototype.forEach.call(document.querySelectorAll("#findings details.more[open]"), function (d) {
      opened[d.getAttribute("data-key")] = true;
    });
    findings.forEach(function (f) {
      // A finding that is another's named cause is told inside that card (caused_by): one story.
      if (f.cause_of) return;
      // Held while clearing: drawn muted, below the active ones (the list's order).
      var card = el("article", "card " + f.severity + (f.clearing_since ? " clearing" : ""));
      card.setAttribute("data-symptom", f.symptom);
      card.setAttribute("data-cause", f.cause);
      if (f.clearing_since) card.setAttribute("data-clearing", "true");
      // What an on-call engineer reads: the headline, the deciding numbers, one next action.
      // The rest (why in prose, other causes, the full check, every value) is folded.
      add(card, add(el("h3"), el("span", "pill " + f.severity, f.severity), document.createTextNode(title(f))),
        add(el("div", "where"), document.createTextNode(where(f) + " \u00b7 " + f.confidence + " confidence \u00b7 "),
          el("span", "since", sinceText(f, signals.last_success_time, (signals.thresholds || {}).finding_hold_seconds))));
      var deciding = el("div", "deciding"), shown = 0;
      (meta.deciding[f.cause] || []).forEach(function (key) {
        var v = (f.evidence || {})[key];
        if (shown >= 3 || v === null || v === undefined) return;
        shown += 1;
        var chip = add(el("span", "num-chip"), document.createTextNode(evidenceLabel(key)), el("b", null, evidenceText(f, key)));
        chip.setAttribute("data-evidence", key);
        deciding.appendChild(chip);
      });
      // The span of the chips' numbers, beside them, where the eye compares them with the figures
      // and the trends (which end on shorter spans): "TTFT p95 28 s" here and 4.56 s at a trend's end.
      var spanned = (f.evidence || {}).window_seconds;
      if (shown && spanned) {
        var spanNote = el("span", "muted span-note", (f.clearing_since ? "as last seen, over " : "over the last ") +
          span(spanned));
        spanNote.setAttribute("data-span", String(spanned));
        deciding.appendChild(spanNote);
      }
      if (shown) card.appendChild(deciding);
      if (f.caused_by) card.appendChild(becauseNode(f.caused_by));
      var next = add(el("p", "next"), el("b", null, "Next: "), document.createTextNode(meta.actions[f.cause] || f.next_check));
      next.setAttribute("data-next", f.cause);
      add(card, next, runbookNode(f));
      var more = el("details", "more"), counted = [], key = [f.symptom, f.cause, f.model_name, f.engine].join("|");
      more.setAttribute("data-key", key);
      more.open = !!opened[key];
      // Its notes, then those of the finding told as its cause (caused_by), each under its own owner.
      var told = [f].concat(f.caused_by ? [f.caused_by] : []);
      var notes = [].concat.apply([], told.map(function (o) { return Object.keys(o.notes || {}).map(function (k) { return [o, k]; }); }));
      var extra = (f.contributing || []).length + (f.alternatives || []).length;
      if (notes.length) counted.push(notes.length + (notes.length === 1 ? " note" : " notes"));
      if (extra) counted.push(extra + " other cause" + (extra === 1 ? "" : "s"));
      counted.push("the full check", Object.keys(f.evidence || {}).length + " values");
      more.appendChild(el("summary", null, "Why, in words: " + counted.join(", ")));
      more.appendChild(el("p", null, f.summary));
      // Prose the diagnosis wrote beside the numbers (`notes`, apart from `evidence`).
      notes.forEach(function (pair) {
        var owner = pair[0], key = pair[1];
        var note = add(el("p", "note"), el("b", null, (owner === f ? "" : (meta.symptoms[owner.symptom] || owner.symptom) + ", ") +
          evidenceLabel(key) + ": "), document.createTextNode(owner.notes[key]));
        note.setAttribute("data-note", key);
        more.appendChild(note);
      });
      // One story: the other causes found for this symptom ride here, not as rival cards;
      // the causes the data cannot tell apart say what would decide.
      (f.contributing || []).forEach(function (c) {
        var p = add(el("p", "factor"), el("b", null, "Contributing: "),
          document.createTextNode((meta.causes[c.cause] || c.cause) + " (" + c.confidence + " confidence). " + c.summary));
        p.setAttribute("data-contributor", c.cause);
        more.appendChild(p);
      });
      (f.alternatives || []).forEach(function (a) {
        var p = add(el("p", "factor"), el("b", null, "Cannot tell apart from: "),
          document.createTextNode((meta.causes[a.cause] || a.cause) + ". Decided by " +
            (a.decided_by || []).map(function (d) { return meta.deciders[d] || d; }).join(" or ") + "."));
        p.setAttribute("data-alternative", a.cause);
        more.appendChild(p);
      });
      more.appendChild(add(el("p"), el("b", null, "Full check: "), document.createTextNode(f.next_check)));
      var table = el("table");
      Object.keys(f.evidence || {}).forEach(function (key) {
        add(table, add(el("tr"), el("td", null, evidenceLabel(key)), el("td", "num", evidenceText(f, key))));
      });
      add(card, add(more, table));
      grid.appendChild(card);
    });
    section.appendChild(grid);
    swap("findings", section);
  }

  function renderChanges(diagnosis) {
    var section = el("section");
    var events = diagnosis.events || [];
    section.appendChild(el("h2", null, "Changes in the window"));
    if (!events.length) section.appendChild(el("p", "muted", "None."));
    else {
      var ul = el("ul", "changes");
      events.forEach(function (e) {
        ul.appendChild(el("li", null, clock(e.time) + " \u00b7 " + e.kind.replace(/_/g, " ") + " \u00b7 " +
          (e.model || "all models") + " / " + (e.engine || "all engines") + ": " + e.detail));
      });
      section.appendChild(ul);
    }
    var u = diagnosis.upstream;
    if (u) {
      section.appendChild(el("h2", null, "Upstream"));
      section.appendChild(el("p", null, u.histogram + " at " + (u.target || "") + ": " +
        (u.up ? "up" : "down (" + (u.reason || "") + ")") + ", mean " + fmt(u.mean_seconds, "seconds") +
        ", p95 " + bounded(fmt(u.p95_seconds, "seconds"), u.p95_pinned) + " over " + fmt(u.count, "requests") + " requests"));
    }
    var tier = diagnosis.lmcache;
    // The multiprocess server's lookups by tier, token-weighted (absent without them).
    var lookupTiers = function (shares) {
      if (!shares) return "";
      return "; looked-up tokens by tier: " + ["l1", "l2", "not_found"].filter(function (t) { return t in shares; })
        .map(function (t) { return t + " " + fmt(shares[t], "ratio"); }).join(", ");
    };
    if (tier) {
      section.appendChild(el("h2", null, "LMCache tier"));
      if (!tier.up) section.appendChild(el("p", "muted", "LMCache at " + (tier.target || "") + ": down (" +
        (tier.reason || "") + (tier.detail ? ": " + tier.detail : "") + "); the engine's signals do not depend on it."));
      (tier.up ? tier.models || [] : []).forEach(function (m) {
        var v = m.signals || {};
        section.appendChild(el("p", null, m.model_name + " at " + (tier.target || "") + ": hit ratio " +
          fmt(v.kvwatch_lmcache_hit_ratio, "ratio") + " (tokens delivered / asked for), prompt tokens from LMCache " +
          fmt(v.kvwatch_lmcache_prompt_tokens_served_ratio, "ratio") + ", tokens retrieved " +
          fmt(v.kvwatch_lmcache_retrieved_tokens_per_second, "per_second") + ", tokens stored " +
          fmt(v.kvwatch_lmcache_stored_tokens_per_second, "per_second") + lookupTiers(v.kvwatch_lmcache_lookup_tokens_by_tier_ratio)));
      });
    }
    var stream = diagnosis.kv_events;
    if (stream) {
      section.appendChild(el("h2", null, "KV-cache events"));
      if (!stream.up) section.appendChild(el("p", "muted", "Events at " + (stream.endpoint || "") + ": down (" +
        (stream.reason || "") + (stream.detail ? ": " + stream.detail : "") + "); the page's signals do not depend on them."));
      else {
        var w = stream.window || {}, intake = stream.intake || {};
        section.appendChild(el("p", null, "At " + stream.endpoint + " over " + fmt(w.seconds, "seconds") + ": blocks stored " +
          fmt(w.stored_per_second, "per_second") + ", evicted " + fmt(w.evicted_per_second, "per_second") +
          ", stored again after their eviction " + fmt(w.stored_again_ratio, "ratio") + " of those stored (median " +
          fmt(w.return_seconds_median, "seconds") + " after the eviction); " + (w.missed || 0) + " messages missed, " +
          (w.dropped || 0) + " dropped"));
        var points = (stream.sizing || {}).points || [];
        if (points.length) section.appendChild(el("p", null, "With more cache (an estimate from the returns' distances): " +
          points.map(function (p) {
            return "x" + p.extra_cache + " " + (p.hit_ratio == null ? fmt(p.recomputation_avoided_ratio, "ratio") + " of the recomputation avoided"
              : "hit ratio " + fmt(p.hit_ratio, "ratio"));
          }).join(", ")));
      }
    }
    swap("changes", section);
  }

  // What the cache is worth per engine: the server writes the sentences (kvwatch/signals/worth.py: lines).
  function renderWorth(signals) {
    var section = el("section"), worth = signals.worth || [];
    if (worth.length) section.appendChild(el("h2", null, "What the cache is worth"));
    worth.forEach(function (w) {
      if (worth.length > 1) section.appendChild(el("p", "muted", w.model_name + (w.engine == null ? "" : " / " + w.engine)));
      (w.lines || []).forEach(function (line) { section.appendChild(el("p", null, line)); });
    });
    swap("worth", section);
  }

  // The signals left dark, grouped by the flag that lights them (dark_groups on the server).
  function darkGroups(dark) {
    var groups = [], index = {};
    dark.forEach(function (item) {
      var flags = (item.lit_by || []).join(" and ") || null;
      var key = JSON.stringify([flags, flags ? "" : item.why]);
      if (!(key in index)) { index[key] = groups.length; groups.push({flags: flags, why: flags ? "" : item.why, items: []}); }
      groups[index[key]].items.push(item);
    });
    return groups;
  }
  function renderDark(signals) {
    var dark = signals.dark_signals || [], section = el("section");
    var before = document.querySelector("#dark details");
    if (dark.length) {
      section.appendChild(el("h2", null, "Signals this engine leaves dark (" + dark.length + ")"));
      var details = el("details"), ul = el("ul");
      details.open = !!(before && before.open);
      details.appendChild(el("summary", null, "Which, why, and the flag that lights them"));
      darkGroups(dark).forEach(function (g) {
        var li = el("li");
        li.setAttribute("data-flag", g.flags || "");
        if (g.flags) add(li, el("code", null, g.flags), document.createTextNode(" lights: "));
        else li.appendChild(document.createTextNode("No flag lights these (" + g.why + "): "));
        g.items.forEach(function (item, i) {
          var s = el("span", null, meta.labels[item.signal] || item.signal);
          s.setAttribute("data-signal", item.signal);
          s.title = item.signal + ": " + item.why;
          if (i) li.appendChild(document.createTextNode(", "));
          li.appendChild(s);
        });
        ul.appendChild(li);
      });
      section.appendChild(add(details, ul));
    }
    swap("dark", section);
  }

  function render() {
    var signals = data.signals, diagnosis = data.diagnosis;
    var rows = enginesWorstFirst(signals, diagnosis);
    var row = rows.filter(function (r) { return keyOf(r) === selected; })[0] || rows[0] || null;
    selected = row ? keyOf(row) : null;
    renderStatus(signals);
    renderPhase(signals);
    renderBanner(signals, diagnosis);
    renderFaults(signals);
    renderFigures(row, signals, diagnosis);
    renderEngines(signals, diagnosis, rows);
    renderTrends(row, data.series);
    renderFindings(signals, diagnosis);
    renderWorth(signals);
    renderChanges(diagnosis);
    renderDark(signals);
  }

  function get(path) {
    return fetch(path, {cache: "no-store", credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (response) {
        if (!response.ok) throw new Error(path + ": HTTP " + response.status);
        return response.json();
      });
  }

  function refresh() {
    // The page's own query (central mode's ?replica=) selects what the API serves.
    var query = window.location.search;
    Promise.all([get("api/v1/signals" + query), get("api/v1/diagnosis" + query), get("api/v1/series" + query)]).then(function (all) {
      data = {signals: all[0], diagnosis: all[1], series: all[2]};
      render();
      updates += 1;
      body.setAttribute("data-updates", String(updates));
      document.getElementById("live").textContent = liveText(data.signals);
    }).catch(function (error) {
      document.getElementById("live").textContent = "Live refresh paused (" + error.message +
        "); showing the last data, retrying every " + (every / 1000) + " s.";
    }).then(function () {
      window.setTimeout(refresh, every);
    });
  }
  render();
  if (data.signals.replay) document.getElementById("live").textContent = liveText(data.signals);
  body.setAttribute("data-rendered", "1");
  window.setTimeout(refresh, every);
})();
