// ferry gateway's live dashboard: polls /gateway/state every second and draws the workers, the
// gateway's load, the latest routing and prefill/decode decisions, and latency over time.
// The admin key (when the gateway has one) stays in this browser's localStorage.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 1000;
  const WINDOW_S = 300; // the charts show the last five minutes
  const dashboard = { state: null, polls: 0 };
  window.ferryDashboard = dashboard; // for a look from the console (and the browser tests)

  const keyInput = $("admin-key");
  keyInput.value = localStorage.getItem("ferry.admin-key") || "";
  keyInput.addEventListener("change", () => { localStorage.setItem("ferry.admin-key", keyInput.value); poll(); });

  const cell = (text, cls) => {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  };
  const clock = (t) => new Date(t * 1000).toLocaleTimeString();
  const fixed = (x, digits) => (x === null || x === undefined ? "-" : Number(x).toFixed(digits));

  function bar(fraction) {
    const td = document.createElement("td");
    const outer = document.createElement("span");
    outer.className = "bar";
    const inner = document.createElement("span");
    inner.style.width = Math.round(Math.min(1, Math.max(0, fraction)) * 100) + "%";
    outer.append(inner);
    td.append(outer, document.createTextNode(Math.round(fraction * 100) + "%"));
    return td;
  }

  function health(w) {
    if (w.healthy) return ["healthy", "badge ok"];
    if (w.reachable && w.circuit_open_s > 0) return ["out for " + Math.ceil(w.circuit_open_s) + " s", "badge warn"];
    return ["down", "badge bad"];
  }

  function drawWorkers(workers) {
    const rows = workers.map((w) => {
      const tr = document.createElement("tr");
      tr.dataset.url = w.url;
      tr.dataset.healthy = String(w.healthy);
      if (!w.healthy) tr.className = "down";
      const role = w.role === "both" ? "prefill + decode" : w.role + (w.prefill_pool ? " (" + w.prefill_pool + ")" : "");
      const [text, cls] = health(w);
      const badge = document.createElement("span");
      badge.className = cls;
      badge.textContent = text;
      const h = document.createElement("td");
      h.className = "health";
      h.append(badge);
      const hits = w.prefix_queries > 0 ? Math.round((100 * w.prefix_hits) / w.prefix_queries) + "%" : "-";
      tr.append(cell(w.url, "url"), cell(role), h, cell(w.models.join(", ") || "-"), cell(String(w.in_flight)),
        cell(String(w.running)), cell(String(w.waiting)), bar(w.kv_usage), cell(hits),
        cell(w.healthy ? "" : w.last_error || "", "last-error"));
      return tr;
    });
    $("workers").tBodies[0].replaceChildren(...rows);
  }

  function drawRouting(decisions) {
    $("routing").tBodies[0].replaceChildren(...decisions.map((d) => {
      const tr = document.createElement("tr");
      tr.append(cell(clock(d.time)), cell(d.model), cell(d.worker, "worker"), cell(d.reason),
        cell(d.overlap === null ? "-" : Math.round(d.overlap * 100) + "%"));
      return tr;
    }));
  }

  function drawPD(disaggregated, decisions) {
    $("pd-section").hidden = !disaggregated;
    $("pd").tBodies[0].replaceChildren(...decisions.map((d) => {
      const tr = document.createElement("tr");
      tr.append(cell(clock(d.time)), cell(d.model), cell(d.decision), cell(d.prefill || "-"), cell(d.decode),
        cell(d.prefill_seconds === null ? "-" : fixed(d.prefill_seconds * 1000, 0) + " ms"));
      return tr;
    }));
  }

  // A line chart of (time, value) over the last WINDOW_S seconds, in SVG, scaled to its largest value.
  const SVG = "http://www.w3.org/2000/svg";
  function chart(svg, now, points, unit) {
    const W = 400, H = 140, left = 34, bottom = 16, top = 8;
    const shown = points.filter((p) => p.value !== null && p.time >= now - WINDOW_S);
    const max = Math.max(1e-9, ...shown.map((p) => p.value));
    const x = (t) => left + ((t - (now - WINDOW_S)) / WINDOW_S) * (W - left - 4);
    const y = (v) => H - bottom - (v / max) * (H - bottom - top);
    const el = (name, attrs, text) => {
      const e = document.createElementNS(SVG, name);
      for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
      if (text !== undefined) e.textContent = text;
      return e;
    };
    const parts = [
      el("line", { x1: left, y1: H - bottom, x2: W - 4, y2: H - bottom, class: "axis" }),
      el("line", { x1: left, y1: top, x2: left, y2: H - bottom, class: "axis" }),
      el("text", { x: left - 4, y: top + 8, "text-anchor": "end" }, shown.length ? fixed(max, max < 10 ? 1 : 0) : ""),
      el("text", { x: left - 4, y: H - bottom, "text-anchor": "end" }, "0"),
      el("text", { x: left, y: H - 3 }, "-5 min"),
      el("text", { x: W - 4, y: H - 3, "text-anchor": "end" }, "now"),
    ];
    if (shown.length > 1) {
      parts.push(el("polyline", { class: "line", points: shown.map((p) => x(p.time) + "," + y(p.value)).join(" ") }));
    }
    for (const p of shown) parts.push(el("circle", { class: "dot", cx: x(p.time), cy: y(p.value), r: 2 }));
    svg.replaceChildren(...parts);
    svg.dataset.points = String(shown.length);
    svg.setAttribute("aria-label", unit + ": " + shown.length + " points");
  }

  function draw(s) {
    $("policy").textContent = "policy " + s.policy + (s.disaggregated ? " · disaggregated" : "") +
      (s.draining ? " · draining" : "");
    const healthy = s.workers.filter((w) => w.healthy).length;
    $("card-healthy").textContent = healthy + " / " + s.workers.length;
    $("card-in-progress").textContent = String(s.in_progress);
    const recent = s.series.filter((p) => p.time >= s.time - 10);
    const mean = (f) => (recent.length ? recent.reduce((a, p) => a + f(p), 0) / (10 / s.slot_seconds) : 0);
    $("card-rps").textContent = fixed(mean((p) => p.requests_per_s), 1);
    $("card-tps").textContent = fixed(mean((p) => p.output_tokens_per_s), 0);
    drawWorkers(s.workers);
    drawRouting(s.routing);
    drawPD(s.disaggregated, s.pd);
    const ms = (f) => s.series.map((p) => ({ time: p.time, value: f(p) === null ? null : f(p) * 1000 }));
    chart($("chart-ttft"), s.time, ms((p) => p.ttft), "TTFT ms");
    chart($("chart-tpot"), s.time, ms((p) => p.tpot), "TPOT ms");
    chart($("chart-tps"), s.time, s.series.map((p) => ({ time: p.time, value: p.output_tokens_per_s })), "tokens/s");
  }

  async function poll() {
    const status = $("status");
    const headers = keyInput.value ? { authorization: "Bearer " + keyInput.value } : {};
    try {
      const resp = await fetch("gateway/state", { headers, cache: "no-store" });
      if (resp.status === 401) throw new Error("this gateway needs its admin key (top right)");
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      const s = await resp.json();
      dashboard.state = s;
      dashboard.polls += 1;
      draw(s);
      status.textContent = s.draining ? "draining" : "live";
      status.className = s.draining ? "badge warn" : "badge ok";
      $("error").hidden = true;
    } catch (e) {
      status.textContent = "not connected";
      status.className = "badge bad";
      $("error").textContent = e.message;
      $("error").hidden = false;
    }
  }

  let timer = null;
  const loop = async () => { await poll(); timer = setTimeout(loop, POLL_MS); };
  loop();
  window.addEventListener("beforeunload", () => clearTimeout(timer));
})();
