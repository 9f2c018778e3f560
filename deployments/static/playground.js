"use strict";
// Backoff Serve playground. Streams a completion over SSE from this server (OpenAI's
// /v1/chat/completions or /v1/completions) and colours every token by its source: the
// `backoff` trace of each chunk says which model of the chain produced it (0 = small) and how
// many earlier tokens a verification rollback retracted. Counters are live while streaming
// and replaced by the final chunk's usage (stream_options.include_usage). No framework, no
// fetch outside this origin.

const BASE = location.pathname.replace(/\/playground\/?$/, ""); // the app's route prefix: "" or "/chain"
const KEY_STORE = "backoff-api-key"; // sessionStorage: the key lives as long as the tab
const $ = (id) => document.getElementById(id);
let routing = null; // GET /v1/routing: levels, routers, live config
let panels = [];
let inFlight = [];

function authHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

async function errorMessage(response) {
  // the server's own message (OpenAI error body), else the status line
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}`;
}

function askForKey(message) {
  $("key-dialog").hidden = false;
  $("key-error").textContent = message || "";
  $("key-input").focus();
}

async function loadRouting() {
  let response;
  try {
    response = await fetch(`${BASE}/v1/routing`, { headers: authHeaders() });
  } catch (e) {
    $("load-error").textContent = `cannot reach the server: ${e}`;
    return;
  }
  if (response.status === 401) return askForKey(await errorMessage(response));
  if (!response.ok) {
    $("load-error").textContent = await errorMessage(response);
    return;
  }
  routing = await response.json();
  $("key-dialog").hidden = true;
  $("load-error").textContent = "";
  setUp();
}

function sourceClass(source) {
  const top = routing.levels.length - 1;
  return source === 0 ? "s-small" : source === top ? "s-large" : "s-medium";
}

function setUp() {
  $("model").textContent = `${routing.model}: ${routing.levels.join(" → ")}`;
  const legend = $("legend");
  legend.replaceChildren(...routing.levels.map((name, i) => {
    const swatch = document.createElement("span");
    swatch.className = `swatch ${sourceClass(i)}`;
    swatch.textContent = name;
    return swatch;
  }));
  if (panels.length) return; // a new key re-reads the routing; the panels stay as they are
  panels = [new Panel("a"), new Panel("b")];
  panels[1].el.hidden = true;
  $("run").disabled = false;
}

function fmt(x, digits) { return Number.isFinite(x) ? x.toFixed(digits) : "–"; }

class Panel {
  constructor(name) {
    this.el = $("panel-template").content.firstElementChild.cloneNode(true);
    this.el.id = `panel-${name}`;
    $("panels").appendChild(this.el);
    this.q = (cls) => this.el.querySelector("." + cls);
    const select = this.q("router");
    for (const r of routing.routers) select.add(new Option(r.name, r.name));
    select.value = routing.routers.some((r) => r.name === routing.router) ? routing.router : routing.routers[0].name;
    select.addEventListener("change", () => this.showThresholds(this.router().defaults));
    this.q("control").addEventListener("change", () => this.showControl());
    this.q("target").addEventListener("input", () => { this.q("target-value").textContent = fmt(+this.q("target").value, 2); });
    if (routing.target_backoff !== null && routing.target_backoff !== undefined) {
      this.q("control").value = "target";
      this.q("target").value = routing.target_backoff;
      this.q("target-value").textContent = fmt(routing.target_backoff, 2);
    }
    this.showThresholds(routing.thresholds.length ? routing.thresholds : this.router().defaults);
    this.showControl();
    this.reset();
  }

  router() { return routing.routers.find((r) => r.name === this.q("router").value); }

  setRouter(name) {
    this.q("router").value = name;
    this.showThresholds(this.router().defaults);
    this.showControl();
  }

  // one slider + number box per boundary between models (a chain of three has two)
  showThresholds(values) {
    const [low, high] = this.router().slider;
    const box = this.q("thresholds");
    box.replaceChildren();
    values.forEach((value, i) => {
      const label = document.createElement("label");
      label.textContent = routing.levels.length > 2 ? `T${i + 1} ` : "T ";
      const slider = Object.assign(document.createElement("input"), {
        type: "range", min: low, max: high, step: (high - low) / 200, value, className: "slider" });
      const number = Object.assign(document.createElement("input"), {
        type: "number", step: "any", value, className: "threshold" });
      slider.addEventListener("input", () => { number.value = (+slider.value).toFixed(3); });
      number.addEventListener("input", () => { slider.value = number.value; });
      label.append(slider, " ", number);
      box.appendChild(label);
    });
    this.showControl();
  }

  showControl() {
    const usesThreshold = this.router().thresholds;
    const target = this.q("control").value === "target";
    this.q("by").hidden = !usesThreshold;
    this.q("thresholds").hidden = !usesThreshold || target;
    this.q("target-box").hidden = !usesThreshold || !target;
  }

  // the request fields this panel sets
  routingFields() {
    const fields = { router: this.q("router").value };
    if (!this.router().thresholds) return fields;
    if (this.q("control").value === "target") fields.target_backoff = +this.q("target").value;
    else fields.thresholds = [...this.el.querySelectorAll("input.threshold")].map((i) => +i.value);
    return fields;
  }

  reset() {
    this.spans = [];
    this.usage = null;
    this.t0 = this.tFirst = null;
    this.q("output").replaceChildren();
    this.q("problem").textContent = "";
    delete this.el.dataset.usage;
    this.showCounters();
    this.setStatus("idle");
  }

  setStatus(text, cls) {
    const status = this.q("status");
    status.textContent = text;
    status.className = `status ${cls || ""}`;
  }

  fail(message) {
    this.q("problem").textContent = message;
    this.setStatus("error", "failed");
  }

  // live from the spans; exact from usage once the final chunk is in
  showCounters() {
    const n = this.usage ? this.usage.completion_tokens : this.spans.length;
    const top = routing.levels.length - 1;
    const bySource = (s) => this.spans.filter((span) => +span.dataset.source === s).length;
    const small = this.usage ? this.usage.small_tokens : bySource(0);
    const large = this.usage ? this.usage.large_tokens : bySource(top);
    // live: one catch-up per large token (exact for every router but the oracles)
    const calls = this.usage ? this.usage.large_calls : large;
    const now = this.tLast || performance.now();
    this.q("c-rate").textContent = n ? `${fmt(100 * small / n, 1)} %` : "–";
    this.q("c-large-calls").textContent = this.t0 === null ? "–" : String(calls);
    const medium = n - small - large;
    this.q("c-tokens").textContent = this.t0 === null ? "–"
      : `${n} (${small} small${medium > 0 ? ` / ${medium} medium` : ""} / ${large} large)`;
    this.q("c-tps").textContent = this.t0 !== null && n ? fmt(n / ((now - this.t0) / 1000), 1) : "–";
    this.q("c-ttft").textContent = this.tFirst !== null ? `${fmt(this.tFirst - this.t0, 0)} ms` : "–";
  }

  onToken(trace, text) {
    // a rollback retracts the last `retracted` tokens before this one is committed
    for (let i = 0; i < (trace.retracted || 0) && this.spans.length; i++) this.spans.pop().remove();
    const span = document.createElement("span");
    span.className = `tok ${sourceClass(trace.source)}`;
    span.dataset.source = trace.source;
    span.title = `${routing.levels[trace.source] || trace.source} · token ${trace.token_id}`;
    span.textContent = text;
    this.q("output").appendChild(span);
    this.spans.push(span);
    const now = performance.now();
    if (this.tFirst === null) this.tFirst = now;
    this.tLast = now;
  }

  // one SSE event: a token chunk, the final chunk (usage), an in-band error, or [DONE]
  onEvent(event) {
    const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
    if (!data) return;
    if (data === "[DONE]") { this.sawDone = true; return; }
    const body = JSON.parse(data);
    if (body.error) return this.fail(body.error.message);
    const choice = (body.choices || [])[0];
    if (choice && choice.backoff) {
      this.onToken(choice.backoff, choice.delta ? (choice.delta.content || "") : (choice.text || ""));
    }
    if (choice && choice.finish_reason) this.finishReason = choice.finish_reason;
    if (body.usage) {
      this.usage = body.usage;
      this.el.dataset.usage = JSON.stringify(body.usage);
    }
    this.showCounters();
  }

  async run(common) {
    this.reset();
    this.finishReason = null;
    this.sawDone = false;
    this.tLast = null;
    const body = { stream: true, stream_options: { include_usage: true }, ...common.fields, ...this.routingFields() };
    if (common.chat) body.messages = [{ role: "user", content: common.prompt }];
    else body.prompt = common.prompt;
    const path = common.chat ? "/v1/chat/completions" : "/v1/completions";
    const abort = new AbortController();
    inFlight.push(abort);
    this.t0 = performance.now();
    this.setStatus("running", "running");
    this.showCounters();
    try {
      const response = await fetch(BASE + path, {
        method: "POST", headers: authHeaders(), body: JSON.stringify(body), signal: abort.signal });
      if (!response.ok) {
        const message = await errorMessage(response);
        if (response.status === 401) askForKey(message);
        return this.fail(message);
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          this.onEvent(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
        }
      }
      if (this.q("status").textContent === "error") return; // failed in-band
      if (!this.usage) return this.fail("the stream ended without its final chunk");
      this.setStatus(`done (${this.finishReason || "?"})`);
    } catch (e) {
      if (abort.signal.aborted) this.setStatus("stopped");
      else this.fail(`request failed: ${e}`);
    } finally {
      this.tLast = this.tLast || performance.now();
      this.showCounters();
      inFlight = inFlight.filter((a) => a !== abort);
    }
  }
}

function commonSettings() {
  const fields = {
    max_tokens: +$("max-tokens").value,
    temperature: +$("temperature").value,
    ignore_eos: $("ignore-eos").checked,
  };
  if ($("seed").value !== "") fields.seed = +$("seed").value;
  return { chat: $("mode").value === "chat", prompt: $("prompt").value, fields };
}

async function run() {
  const active = $("compare").checked ? panels : panels.slice(0, 1);
  $("run").disabled = true;
  $("stop").disabled = false;
  const common = commonSettings();
  await Promise.all(active.map((p) => p.run(common)));
  $("run").disabled = false;
  $("stop").disabled = true;
}

$("run").disabled = true;
$("run").addEventListener("click", run);
$("stop").addEventListener("click", () => inFlight.forEach((a) => a.abort()));
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) run(); });
$("compare").addEventListener("change", () => {
  const on = $("compare").checked;
  $("panels").classList.toggle("compare", on);
  if (!panels.length) return;
  if (on && panels[1].el.hidden && !panels[1].touched) {
    // the reference beside the live setting: every token from the largest model
    panels[1].setRouter(routing.routers.some((r) => r.name === "always-large") ? "always-large" : routing.router);
    panels[1].touched = true;
  }
  panels[1].el.hidden = !on;
});
$("key-submit").addEventListener("click", () => {
  sessionStorage.setItem(KEY_STORE, $("key-input").value.trim());
  loadRouting();
});
$("key-input").addEventListener("keydown", (e) => { if (e.key === "Enter") $("key-submit").click(); });
loadRouting();
