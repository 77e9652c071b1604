// Coda playground: chat over /v1/chat/completions (SSE), the coda outcome object, the
// request's lifecycle timeline from GET /v1/traces/{id}, cancel, and live /metrics.
// Plain browser JavaScript: no build step, no dependencies, nothing fetched from elsewhere.
// The API key lives in this page's memory only (never stored).
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: "", model: null, messages: [], current: null, lastTokens: null };

function headers(json) {
  const h = {};
  if (json) h["content-type"] = "application/json";
  if (state.key) h["authorization"] = "Bearer " + state.key;
  return h;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers(false) });
    if (!r.ok) { $("model").textContent = r.status === 401 ? "API key needed" : "models: " + r.status; return; }
    const data = await r.json();
    const ids = data.data.map((m) => m.id);
    if (!ids.includes(state.model)) state.model = ids[0];
    // several models (coda serve --model A --model B): pick one; each loads on first use
    const pick = $("model-pick");
    pick.replaceChildren(...data.data.map((m) => {
      const o = el("option", null, m.coda_model ? m.id + " (" + m.coda_model.status + ")" : m.id);
      o.value = m.id;
      return o;
    }));
    pick.value = state.model;
    $("model-pick-label").hidden = ids.length < 2;
    $("model").textContent = ids.length < 2 ? "model: " + state.model : "";
  } catch (e) { $("model").textContent = "server unreachable"; }
}

$("model-pick").addEventListener("change", () => { state.model = $("model-pick").value; });

function stopStrings() {
  const raw = $("stop").value;
  if (!raw.trim()) return undefined;
  try { const v = JSON.parse(raw); if (Array.isArray(v)) return v; } catch (e) { /* lines */ }
  return raw.split("\n").filter((s) => s.length > 0);
}

function addMessage(role, text) {
  const m = el("div", "msg " + role);
  const body = el("span", "text", text);
  m.appendChild(body);
  $("transcript").appendChild(m);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return m;
}

// Reads an SSE body; calls onData(json) for each `data:` payload except [DONE].
async function readSSE(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const payload = line.slice(6);
        if (payload === "[DONE]") return;
        onData(JSON.parse(payload));
      }
    }
  }
}

async function send(ev) {
  ev.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || state.current) return;
  if (!state.model) await loadModel();
  state.messages.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  $("prompt").value = "";  // sent: the box is ready for the next turn
  const bubble = addMessage("assistant streaming", "");
  const text = bubble.querySelector(".text");
  const body = { model: state.model, messages: state.messages, stream: true,
                 max_tokens: Number($("max-tokens").value) || 128,
                 temperature: Number($("temperature").value) };
  const stop = stopStrings();
  if (stop) body.stop = stop;
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const run = { id: null, text: "", coda: null, wire: null };
  state.current = run;
  $("send").disabled = true;
  $("cancel").disabled = false;
  resetOutcome();
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(body) });
    run.id = resp.headers.get("x-request-id");
    $("request-id").textContent = run.id || "";
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || ("HTTP " + resp.status));
    }
    await readSSE(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (!run.id && chunk.id) { run.id = chunk.id; $("request-id").textContent = run.id; }
      for (const c of chunk.choices || []) {
        if (c.delta && c.delta.content) { run.text += c.delta.content; text.textContent = run.text; }
        if (c.finish_reason) run.wire = c.finish_reason;
      }
      if (chunk.coda) run.coda = chunk.coda;
    });
    state.messages.push({ role: "assistant", content: run.text });
    const meta = el("span", "meta", run.coda ? run.coda.finish_reason : "");
    bubble.appendChild(meta);
  } catch (e) {
    bubble.classList.add("error");
    text.textContent = run.text + (run.text ? "\n" : "") + "error: " + e.message;
    state.messages.pop();
  } finally {
    bubble.classList.remove("streaming");
    state.current = null;
    $("send").disabled = false;
    $("cancel").disabled = true;
    showOutcome(run);
    if (run.id) await showTrace(run.id);
  }
}

async function cancel() {
  const run = state.current;
  if (!run || !run.id) return;
  $("cancel").disabled = true;
  await fetch("/v1/requests/" + encodeURIComponent(run.id) + "/cancel", { method: "POST", headers: headers(false) });
}

function resetOutcome() {
  for (const id of ["finish-reason", "wire-reason", "matched-stop"]) $(id).textContent = "…";
  $("usage").replaceChildren(); $("timings").replaceChildren();
  $("timeline").replaceChildren(); $("timeline-bar").replaceChildren(); $("cancel-times").replaceChildren();
}

function table(target, obj, fmt) {
  target.replaceChildren();
  for (const [k, v] of Object.entries(obj || {})) {
    const tr = el("tr");
    tr.appendChild(el("td", "", k));
    tr.appendChild(el("td", "", v === null || v === undefined ? "–" : fmt(v)));
    target.appendChild(tr);
  }
}

function showOutcome(run) {
  const c = run.coda;
  $("finish-reason").textContent = c ? c.finish_reason : "–";
  $("wire-reason").textContent = run.wire || "–";
  $("matched-stop").textContent = c && c.matched_stop !== null ? JSON.stringify(c.matched_stop) : "–";
  if (!c) return;
  table($("usage"), c.usage, (v) => String(v));
  table($("timings"), c.timings, (v) => (v * 1000).toFixed(1) + " ms");
}

const PHASES = ["QUEUED", "PREFILLING", "DECODING", "DRAINING", "CANCEL_REQUESTED"];

async function showTrace(id) {
  const r = await fetch("/v1/traces/" + encodeURIComponent(id), { headers: headers(false) });
  const list = $("timeline");
  if (!r.ok) { list.replaceChildren(el("li", "", "no trace (" + r.status + ")")); return; }
  const data = await r.json();
  const rows = data.rows;
  const end = rows.length ? rows[rows.length - 1].t_ms : 0;
  // phases: from each lifecycle transition to the next one
  const bar = $("timeline-bar");
  bar.replaceChildren();
  const changes = rows.filter((x) => x.kind === "lifecycle");
  changes.forEach((x, i) => {
    const stopAt = i + 1 < changes.length ? changes[i + 1].t_ms : end;
    if (!PHASES.includes(x.to)) return;
    const seg = el("div", "", x.to.toLowerCase());
    seg.style.flexGrow = String(Math.max(stopAt - x.t_ms, end / 200 || 0.001));
    seg.style.background = "var(--" + x.to + ")";
    seg.title = x.to + " " + (stopAt - x.t_ms).toFixed(2) + " ms";
    seg.dataset.state = x.to;
    bar.appendChild(seg);
  });
  list.replaceChildren();
  let tokens = 0, deltas = 0, holding = false;
  const cancels = [];
  for (const x of rows) {
    const t = x.t_ms.toFixed(2).padStart(8) + " ms  ";
    if (x.kind === "token.selected") { tokens++; continue; }
    if (x.kind === "stream.delta") { deltas++; continue; }
    let li = null;
    if (x.kind === "lifecycle") li = el("li", "lifecycle", t + x.from + " → " + x.to);
    else if (x.kind === "stop.state") {
      if (x.held > 0 && !holding) li = el("li", "hold", t + "stop buffer holds " + x.held + " byte(s)");
      else if (x.held === 0 && holding) li = el("li", "hold", t + "stop buffer released");
      holding = x.held > 0;
    } else if (x.kind === "stop.hit") li = el("li", "hold", t + "stop hit " + JSON.stringify(x.stop));
    else if (x.kind.startsWith("cancel.")) {
      li = el("li", "cancel", t + x.kind + (x.cause ? " (" + x.cause + ")" : ""));
      cancels.push([x.kind, x.t_ms]);
    } else if (x.kind === "terminal") li = el("li", "terminal", t + "terminal: " + x.state + " · " + x.reason);
    else if (x.kind === "grammar.forced_close") li = el("li", "hold", t + "grammar forced close (" + x.path_tokens + " tokens)");
    if (li) { li.dataset.kind = x.kind; list.appendChild(li); }
  }
  list.appendChild(el("li", "muted", tokens + " tokens selected, " + deltas + " deltas" +
    (data.dropped_rows ? ", " + data.dropped_rows + " rows past the bound" : "")));
  const ct = $("cancel-times");
  ct.replaceChildren();
  if (cancels.length) {
    ct.textContent = "cancel: " + cancels.map(([k, v]) => k.slice(7) + " @ " + v.toFixed(2) + " ms").join(" · ");
  }
}

// -- live metrics --------------------------------------------------------------------------
function metric(text, name) {
  const re = new RegExp("^" + name.replace(/[:]/g, "\\:") + "(?:\\{[^}]*\\})?\\s+([0-9.eE+-]+)$", "gm");
  let m, total = null;
  while ((m = re.exec(text)) !== null) total = (total || 0) + Number(m[1]);
  return total;
}

async function pollMetrics() {
  try {
    const r = await fetch("/metrics", { headers: headers(false) });
    if (!r.ok) { $("metrics-error").textContent = "metrics: HTTP " + r.status; return; }
    $("metrics-error").textContent = "";
    const text = await r.text();
    $("m-running").textContent = metric(text, "coda:num_requests_running") ?? "–";
    $("m-waiting").textContent = metric(text, "coda:num_requests_waiting") ?? "–";
    const kv = metric(text, "coda:kv_cache_usage_perc");
    $("m-kv").textContent = kv === null ? "–" : (kv * 100).toFixed(1) + " %";
    const gen = metric(text, "coda:generation_tokens_total");
    const now = performance.now();
    if (gen !== null && state.lastTokens) {
      const [g0, t0] = state.lastTokens;
      $("m-tps").textContent = ((gen - g0) / ((now - t0) / 1000)).toFixed(1);
    }
    if (gen !== null) state.lastTokens = [gen, now];
  } catch (e) { $("metrics-error").textContent = "metrics unreachable"; }
}

$("composer").addEventListener("submit", send);
$("cancel").addEventListener("click", cancel);
$("clear").addEventListener("click", () => { state.messages = []; $("transcript").replaceChildren(); });
$("api-key").addEventListener("change", () => { state.key = $("api-key").value; state.model = null; loadModel(); pollMetrics(); });
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e); });
loadModel();
pollMetrics();
setInterval(pollMetrics, 1000);
