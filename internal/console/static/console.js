// outboxd console: live lag on the streams page. Polls /api/lag and redraws
// the streams table and an SVG chart of pending events over the sampled
// window. No library, no inline script (the page's CSP forbids it).
(function () {
  "use strict";
  var root = document.getElementById("lag");
  if (!root) return;
  var pollMs = parseInt(root.getAttribute("data-poll-ms"), 10) || 5000;
  var colors = ["#2563eb", "#c62828", "#1b7f3b", "#b26a00", "#7c3aed", "#0891b2"];
  var NS = "http://www.w3.org/2000/svg";

  function el(name, attrs, text) {
    var e = document.createElement(name);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function svg(name, attrs, text) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function rate(f) { return f.toFixed(1) + "/s"; }
  function set(id, v) { var e = document.getElementById(id); if (e) e.textContent = v; }

  function renderTable(d) {
    var body = document.querySelector("#streams tbody");
    body.textContent = "";
    if (!d.streams.length) {
      var tr = el("tr");
      tr.appendChild(el("td", { colspan: "13", "class": "muted" }, "No stream has had an event yet."));
      body.appendChild(tr);
    }
    d.streams.forEach(function (s) {
      var tr = el("tr");
      var td = el("td");
      td.appendChild(el("a", { href: "/events?state=pending&stream=" + encodeURIComponent(s.stream) }, s.stream));
      tr.appendChild(td);
      [[s.pending], [s.aggregates], [s.oldest], [rate(s.rate)], [s.ready], [s.leased],
       [s.backoff, "warn"], [s.parked, "bad"], [s.gap, "bad"], [s.stalled, "bad"], [s.stranded, "bad"], [s.idle_relays, "warn"]].forEach(function (c) {
        tr.appendChild(el("td", { "class": "n" + (c[1] && c[0] ? " " + c[1] : "") }, String(c[0])));
      });
      body.appendChild(tr);
    });
    set("total-pending", d.total.pending);
    set("total-oldest", d.total.oldest);
    set("total-rate", rate(d.total.rate));
    set("relays", d.connected_relays);
    set("updated", "updated " + new Date(d.now).toLocaleTimeString());
    var warnings = document.getElementById("warnings");
    warnings.textContent = "";
    (d.warnings || []).forEach(function (w) { warnings.appendChild(el("p", { "class": "flash error" }, w)); });
  }

  // niceStep is the gridline step for values up to v over four steps: 1, 2
  // or 5 times a power of ten and at least 1, so that every label is a whole
  // number on its gridline (a maximum of 5 over four steps would put "1" on
  // the line at 1.25).
  function niceStep(v) {
    var raw = Math.max(v / 4, 1);
    var p = Math.pow(10, Math.floor(Math.log10(raw)));
    var m = [1, 2, 5, 10].find(function (f) { return f * p >= raw; });
    return m * p;
  }

  function renderChart(d) {
    var box = document.getElementById("chart");
    var legend = document.getElementById("legend");
    var hist = d.history;
    if (hist.length < 2) return; // keeps "Collecting samples…"
    var W = box.clientWidth || 900, H = box.clientHeight || 240;
    var L = 48, R = 12, T = 10, B = 24;
    var t1 = new Date(d.now).getTime(), t0 = t1 - d.window_s * 1000;
    // The busiest streams now, plus the total.
    var names = {};
    hist.forEach(function (h) { for (var n in h.streams) names[n] = Math.max(names[n] || 0, h.streams[n].pending); });
    var top = Object.keys(names).sort(function (a, b) { return names[b] - names[a]; }).slice(0, 5);
    var series = [{ name: "all streams", pts: hist.map(function (h) { return [h.at, h.total.pending]; }) }];
    top.forEach(function (n) {
      series.push({ name: n, pts: hist.map(function (h) { return [h.at, h.streams[n] ? h.streams[n].pending : 0]; }) });
    });
    var step = niceStep(Math.max.apply(null, series[0].pts.map(function (p) { return p[1]; }).concat([1])));
    var ymax = 4 * step;
    var x = function (t) { return L + (W - L - R) * (new Date(t).getTime() - t0) / (t1 - t0); };
    var y = function (v) { return T + (H - T - B) * (1 - v / ymax); };
    var s = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img" });
    for (var i = 0; i <= 4; i++) {
      var v = step * i, yy = y(v);
      s.appendChild(svg("line", { x1: L, x2: W - R, y1: yy, y2: yy, "class": i ? "gridline" : "axis" }));
      s.appendChild(svg("text", { x: L - 6, y: yy + 4, "text-anchor": "end", "class": "ytick" }, String(v)));
    }
    for (var m = 0; m <= 6; m++) {
      var t = t0 + (t1 - t0) * m / 6;
      s.appendChild(svg("text", { x: x(t), y: H - 6, "text-anchor": m === 0 ? "start" : m === 6 ? "end" : "middle" },
        new Date(t).toLocaleTimeString([], d.window_s > 600 ? { hour: "2-digit", minute: "2-digit" } : { hour: "2-digit", minute: "2-digit", second: "2-digit" })));
    }
    legend.textContent = "";
    series.forEach(function (se, k) {
      var c = colors[k % colors.length];
      var dpath = se.pts.map(function (p, j) { return (j ? "L" : "M") + x(p[0]).toFixed(1) + " " + y(p[1]).toFixed(1); }).join(" ");
      s.appendChild(svg("path", { d: dpath, "class": "series", stroke: c, "stroke-dasharray": k ? "" : "5 3" }));
      var item = el("span");
      var sw = el("i"); sw.style.background = c;
      item.appendChild(sw);
      item.appendChild(document.createTextNode(se.name + " (" + se.pts[se.pts.length - 1][1] + ")"));
      legend.appendChild(item);
    });
    box.textContent = "";
    box.appendChild(s);
  }

  function poll() {
    fetch("/api/lag", { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) {
        if (r.status === 401) { window.location = "/login"; throw new Error("logged out"); }
        return r.json();
      })
      .then(function (d) {
        if (d.error) { set("updated", d.error); return; }
        renderTable(d);
        renderChart(d);
        root.setAttribute("data-polls", String((parseInt(root.getAttribute("data-polls"), 10) || 0) + 1));
      })
      .catch(function () {})
      .then(function () { setTimeout(poll, pollMs); });
  }
  poll();
})();
