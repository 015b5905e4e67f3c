// app.js -- the swarm page: polls /v1/swarm, /health and /metrics about once a second and
// draws the members, the chain and the throughput; streams chat answers from
// /v1/chat/completions. Every string from the server is rendered with textContent or an SVG
// text node, never as HTML. The API key lives in this tab's sessionStorage and travels only
// in the Authorization header.
"use strict";

(function () {
  const POLL_MS = 1000;
  const KEY_ITEM = "fusion.apiKey";
  const SVG_NS = "http://www.w3.org/2000/svg";
  const STATES = ["active", "serving", "static", "moving", "loading", "joining", "spare", "gone",
    "unreachable", "unauthorized", "failed"];
  const $ = (id) => document.getElementById(id);

  let modelId = null;
  let counters = null; // the previous poll's token counters: {t, gen, prompt}
  let timer = null;

  class AuthError extends Error {}

  // ---- the API --------------------------------------------------------------------------

  function authHeaders(extra) {
    const h = Object.assign({}, extra);
    const key = sessionStorage.getItem(KEY_ITEM);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function api(path, init) {
    const r = await fetch(path, Object.assign({ headers: authHeaders(), cache: "no-store" }, init));
    if (r.status === 401) throw new AuthError("the gateway refused the API key");
    return r;
  }

  async function apiJson(path, okStatuses) {
    const r = await api(path);
    if (!r.ok && !(okStatuses || []).includes(r.status)) throw new Error(path + ": HTTP " + r.status);
    return r.json();
  }

  async function apiText(path) {
    const r = await api(path);
    if (!r.ok) throw new Error(path + ": HTTP " + r.status);
    return r.text();
  }

  // Prometheus text: [{name, labels: {k: v}, value}].
  function parseMetrics(text) {
    const out = [];
    for (const line of text.split("\n")) {
      const m = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
      if (!m) continue;
      const labels = {};
      for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
      out.push({ name: m[1], labels: labels, value: Number(m[3]) });
    }
    return out;
  }

  function metric(samples, name) {
    const s = samples.find((x) => x.name === name);
    return s ? s.value : NaN;
  }

  // ---- formatting -------------------------------------------------------------------------

  function num(x, digits) {
    return Number.isFinite(x) ? x.toFixed(digits === undefined ? 1 : digits) : "-";
  }

  function bytes(x) {
    if (!Number.isFinite(x) || x < 0) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
    return (i ? x.toFixed(1) : String(x)) + " " + units[i];
  }

  function spanText(span) {
    return Array.isArray(span) ? "[" + span[0] + ", " + span[1] + ")" : span ? String(span) : "-";
  }

  function stateClass(state) {
    return "state-" + (STATES.includes(state) ? state : "other");
  }

  // ---- the swarm document --------------------------------------------------------------------

  // The members, each with its figures; a static chain's come from /metrics' per-shard gauges.
  function members(swarm, samples) {
    const byShard = {};
    for (const s of samples) {
      if (!s.name.startsWith("fusion_shard_") || !s.labels.shard) continue;
      const o = byShard[s.labels.shard] || (byShard[s.labels.shard] = { state: s.labels.state });
      o[s.name.slice("fusion_shard_".length)] = s.value;
    }
    return (swarm.servers || []).map((m) => {
      const g = byShard[m.address] || {};
      const out = Object.assign({}, m);
      if (m.state === "static" && g.state) out.state = g.state;
      if (out.tokens_per_s === undefined) out.tokens_per_s = g.tokens_per_second;
      if (out.sessions === undefined) out.sessions = g.sessions;
      if (out.free_kv_bytes === undefined) out.free_kv_bytes = g.kv_free_bytes;
      if (out.total_kv_bytes === undefined) out.total_kv_bytes = g.kv_total_bytes;
      return out;
    });
  }

  // The flow on each hop: the swarm's, or a static chain's hops in order (no figures).
  function hops(swarm, list) {
    if (swarm.flow) return swarm.flow;
    const chain = list.filter((m) => Array.isArray(m.span)).sort((a, b) => a.span[0] - b.span[0]);
    const names = ["gateway"].concat(chain.map((m) => m.address), ["gateway"]);
    return names.slice(1).map((to, i) => ({ from: names[i], to: to, tokens_per_s: null }));
  }

  // ---- rendering: figures and members ----------------------------------------------------------

  function renderFigures(swarm, list, samples, health) {
    const now = performance.now() / 1000;
    const gen = metric(samples, "fusion_gateway_generation_tokens_total");
    const prompt = metric(samples, "fusion_gateway_prompt_tokens_total");
    if (counters && now > counters.t) {
      $("fig-gen").textContent = num((gen - counters.gen) / (now - counters.t));
      $("fig-prompt").textContent = num((prompt - counters.prompt) / (now - counters.t));
    }
    counters = { t: now, gen: gen, prompt: prompt };
    $("fig-running").textContent = num(metric(samples, "fusion_gateway_running_requests"), 0);
    $("fig-queue").textContent = num(metric(samples, "fusion_gateway_queue_depth"), 0);
    $("fig-sessions").textContent = num(metric(samples, "fusion_gateway_active_sessions"), 0);
    $("fig-flow").textContent = num(swarm.max_flow);
    $("fig-planned").textContent = swarm.planner ? num(swarm.planner.decode_tokens_per_s) : "-";
    const live = list.filter((m) => !["gone", "unreachable", "unauthorized"].includes(m.state)).length;
    $("fig-members").textContent = live + " / " + list.length;
    $("fig-uncovered").textContent = swarm.uncovered_blocks === undefined ? "-" : String(swarm.uncovered_blocks);
    const ready = health && health.status === "ok";
    $("ready").textContent = ready ? "ready" : "not ready" + (health && health.reason ? ": " + health.reason : "");
    $("ready").className = "badge " + (ready ? "ok" : "bad");
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  }

  function cell(tr, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    tr.appendChild(td);
  }

  function renderMembers(list) {
    const rows = list.map((m) => {
      const tr = document.createElement("tr");
      tr.dataset.address = m.address;
      tr.dataset.state = m.state;
      const link = m.link || {};
      const used = m.total_kv_bytes - m.free_kv_bytes;
      cell(tr, m.address, "address");
      cell(tr, spanText(m.span));
      cell(tr, m.device || "-");
      cell(tr, m.state, "state " + stateClass(m.state));
      cell(tr, num(m.tokens_per_s), "num");
      cell(tr, m.sessions === undefined ? "-" : String(m.sessions), "num");
      cell(tr, bytes(used), "num");
      cell(tr, bytes(m.free_kv_bytes), "num");
      cell(tr, link.rtt_s === undefined ? "-" : num(link.rtt_s * 1000, 2) + " ms", "num");
      cell(tr, link.bandwidth_bytes_per_s ? bytes(link.bandwidth_bytes_per_s) + "/s" : "-", "num");
      cell(tr, m.flow === undefined ? "-" : num(m.flow), "num");
      if (m.error) tr.title = m.error;
      return tr;
    });
    $("members").tBodies[0].replaceChildren(...rows);
  }

  // ---- rendering: the chain picture --------------------------------------------------------------

  function svg(parent, tag, attrs, text) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const k in attrs) el.setAttribute(k, attrs[k]);
    if (text !== undefined) el.textContent = text;
    parent.appendChild(el);
    return el;
  }

  function renderAxis(g, n, x, y) {
    const step = Math.max(1, Math.ceil(n / 12));
    svg(g, "line", { x1: x(0), y1: y, x2: x(n), y2: y, class: "axis" });
    for (let b = 0; b <= n; b += step) {
      svg(g, "line", { x1: x(b), y1: y - 4, x2: x(b), y2: y, class: "axis" });
      svg(g, "text", { x: x(b), y: y - 8, class: "tick" }, String(b));
    }
    svg(g, "text", { x: x(0) - 8, y: y - 8, class: "tick end" }, "block");
  }

  // A hop's curve from a to b with its flow as a label (beside a server-to-server hop, above a
  // gateway's); its width by its share of the largest hop's flow.
  function renderHop(g, a, b, flow, maxFlow, gatewayHop) {
    const mid = (a[0] + b[0]) / 2;
    const width = flow && maxFlow ? 1.5 + 6 * (flow / maxFlow) : 1.5;
    svg(g, "path", { d: `M${a[0]},${a[1]} C${mid},${a[1]} ${mid},${b[1]} ${b[0]},${b[1]}`, class: "hop",
      "stroke-width": width.toFixed(1) });
    if (!flow) return;
    const label = num(flow) + " tok/s";
    if (gatewayHop) svg(g, "text", { x: mid, y: a[1] - 8, class: "hop-label middle" }, label);
    else svg(g, "text", { x: mid + 6, y: (a[1] + b[1]) / 2 + 4, class: "hop-label" }, label);
  }

  function renderChain(swarm, list) {
    const el = $("chain");
    const spans = list.filter((m) => Array.isArray(m.span))
      .sort((a, b) => a.span[0] - b.span[0] || a.address.localeCompare(b.address));
    const n = swarm.n_layers || Math.max(1, ...spans.map((m) => m.span[1]));
    const W = 1000, L = 140, R = 140, GW = 64, TOP = 34, LANE = 40;
    const H = TOP + Math.max(1, spans.length) * LANE + 12;
    const x = (b) => L + (b * (W - L - R)) / n;
    const lane = {};
    spans.forEach((m, i) => { lane[m.address] = { y: TOP + i * LANE + LANE / 2, span: m.span }; });
    el.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const g = document.createElementNS(SVG_NS, "g");
    renderAxis(g, n, x, TOP - 6);
    for (const gx of [8, W - 8 - GW]) {
      svg(g, "rect", { x: gx, y: TOP, width: GW, height: H - TOP - 12, rx: 6, class: "gateway" });
      svg(g, "text", { x: gx + GW / 2, y: (TOP + H - 12) / 2 + 4, class: "gateway-label" }, "gateway");
    }
    const flows = hops(swarm, spans);
    const maxFlow = Math.max(0, ...flows.map((h) => h.tokens_per_s || 0));
    for (const h of flows) {
      const from = lane[h.from], to = lane[h.to];
      if ((h.from !== "gateway" && !from) || (h.to !== "gateway" && !to)) continue;
      const a = from ? [x(from.span[1]), from.y] : [8 + GW, to.y];
      const b = to ? [x(to.span[0]), to.y] : [W - 8 - GW, from.y];
      renderHop(g, a, b, h.tokens_per_s, maxFlow, !from || !to);
    }
    for (const m of spans) {
      const y = lane[m.address].y;
      svg(g, "rect", { x: x(m.span[0]) + 1, y: y - 11, width: Math.max(2, x(m.span[1]) - x(m.span[0]) - 2),
        height: 22, rx: 4, class: "bar " + stateClass(m.state) });
      svg(g, "text", { x: (x(m.span[0]) + x(m.span[1])) / 2, y: y + 4, class: "bar-label" }, m.address);
    }
    el.replaceChildren(g);
  }

  // ---- polling and the key ----------------------------------------------------------------------

  function setError(text) {
    $("error").textContent = text;
  }

  function askKey(message) {
    clearTimeout(timer);
    sessionStorage.removeItem(KEY_ITEM);
    $("main").hidden = true;
    $("key-form").hidden = false;
    $("key-error").textContent = message || "";
    $("ready").textContent = "API key needed";
    $("ready").className = "badge";
    $("key").focus();
  }

  async function loadModel() {
    const models = await apiJson("/v1/models");
    modelId = models.data && models.data.length ? models.data[0].id : null;
    $("model").textContent = modelId || "";
  }

  async function poll() {
    clearTimeout(timer);
    try {
      if (!modelId) await loadModel();
      const [swarm, metricsText, health] = await Promise.all([apiJson("/v1/swarm"), apiText("/metrics"),
        apiJson("/health", [503])]);
      const samples = parseMetrics(metricsText);
      const list = members(swarm, samples);
      $("key-form").hidden = true;
      $("main").hidden = false;
      renderFigures(swarm, list, samples, health);
      renderMembers(list);
      renderChain(swarm, list);
      setError("");
    } catch (e) {
      if (e instanceof AuthError) {
        askKey(sessionStorage.getItem(KEY_ITEM) ? e.message : "");
        return;
      }
      setError("cannot reach the gateway: " + e.message);
    }
    timer = setTimeout(poll, POLL_MS);
  }

  function onKey(ev) {
    ev.preventDefault();
    const key = $("key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_ITEM, key);
    $("key").value = "";
    $("key-error").textContent = "";
    poll();
  }

  // ---- chat -------------------------------------------------------------------------------------

  // Reads an SSE body, calling onData(json) for each "data:" event until [DONE].
  async function readEvents(body, onData) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return true;
          onData(JSON.parse(data));
        }
      }
    }
  }

  async function errorOf(r) {
    const j = await r.json().catch(() => null);
    return (j && j.error && j.error.message) || "HTTP " + r.status;
  }

  async function chat(ev) {
    ev.preventDefault();
    const prompt = $("prompt").value.trim();
    if (!prompt) return;
    const answer = $("answer"), status = $("chat-status"), send = $("send");
    const text = document.createTextNode("");
    answer.replaceChildren(text);
    answer.dataset.state = "streaming";
    send.disabled = true;
    status.textContent = "streaming...";
    const t0 = performance.now();
    let chunks = 0;
    try {
      const r = await api("/v1/chat/completions", { method: "POST",
        headers: authHeaders({ "Content-Type": "application/json" }),
        body: JSON.stringify({ model: modelId, messages: [{ role: "user", content: prompt }], stream: true,
          max_tokens: Number($("max-tokens").value) || 96 }) });
      if (!r.ok) throw new Error(await errorOf(r));
      const finished = await readEvents(r.body, (ev) => {
        if (ev.error) throw new Error(ev.error.message || "the generation failed");
        const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
        if (delta && delta.content) {
          text.appendData(delta.content);
          answer.dataset.chunks = String(++chunks);
        }
      });
      if (!finished) throw new Error("the stream ended early");
      const s = (performance.now() - t0) / 1000;
      status.textContent = `done: ${chunks} chunks in ${s.toFixed(1)} s`;
      answer.dataset.state = "done";
    } catch (e) {
      if (e instanceof AuthError) askKey(e.message);
      status.textContent = "error: " + e.message;
      answer.dataset.state = "error";
    } finally {
      send.disabled = false;
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("key-form").addEventListener("submit", onKey);
    $("chat-form").addEventListener("submit", chat);
    poll();
  });
})();
