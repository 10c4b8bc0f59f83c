// ortfleet console: the fleet, a playground and the jobs of a key, read from this gateway's API.
// Plain script, no dependency; every request goes to this page's own origin.
"use strict";

(() => {
  const KEY_ITEM = "ortfleet.key";
  const FLEET_EVERY_MS = 2000;
  const BATCHES_EVERY_MS = 10000;
  const $ = (id) => document.getElementById(id);

  // ---- API access ---------------------------------------------------------------------------

  class ApiFailure extends Error {
    constructor(status, message, code) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  const key = () => sessionStorage.getItem(KEY_ITEM);
  let answeredWithoutKey = false; // a gateway without keys

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const k = key();
    if (k) h.Authorization = "Bearer " + k;
    return h;
  }

  async function failure(response, quiet) {
    let message = response.status + " " + response.statusText;
    let code = null;
    try {
      const body = await response.json();
      if (body && body.error) {
        message = body.error.message || message;
        code = body.error.code || null;
      }
    } catch (_) { /* not JSON */ }
    if (response.status === 401 && !quiet) askForKey(key() ? "This key was refused: " + message : "This gateway needs an API key.");
    return new ApiFailure(response.status, message, code);
  }

  async function api(path, options) {
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.headers);
    const quiet = opts.quiet;
    delete opts.quiet;
    const response = await fetch(path, opts);
    if (!response.ok) throw await failure(response, quiet);
    if (!key() && !answeredWithoutKey) {
      answeredWithoutKey = true;
      showKeyState();
    }
    if (response.status === 204) return null;
    return response.json();
  }

  // Server-Sent Events from a fetch response: yields {id, event, data} (data as text).
  async function* sseEvents(response, signal) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
          const event = { id: null, event: "message", data: "" };
          const data = [];
          for (const line of block.split(/\r?\n/)) {
            if (!line || line.startsWith(":")) continue;
            const colon = line.indexOf(":");
            const field = colon < 0 ? line : line.slice(0, colon);
            const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
            if (field === "data") data.push(text);
            else if (field === "event") event.event = text;
            else if (field === "id") event.id = text;
          }
          if (!data.length) continue;
          event.data = data.join("\n");
          yield event;
        }
        if (signal && signal.aborted) break;
      }
    } finally {
      reader.releaseLock();
    }
  }

  function showNotice(text) {
    const notice = $("notice");
    notice.textContent = text || "";
    notice.hidden = !text;
  }

  // ---- key --------------------------------------------------------------------------------------

  function showKeyState() {
    $("key-status").textContent = key() ? "key set for this tab" : answeredWithoutKey ? "no key needed" : "no key";
    $("key-forget").hidden = !key();
  }

  function askForKey(reason) {
    $("key-reason").textContent = reason;
    const panel = $("key-panel");
    if (panel.hidden) {
      panel.hidden = false;
      $("key-input").focus();
    }
  }

  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const value = $("key-input").value.trim();
    if (!value) return;
    sessionStorage.setItem(KEY_ITEM, value);
    $("key-input").value = "";
    $("key-panel").hidden = true;
    showKeyState();
    showNotice("");
    refreshAll();
  });
  $("key-change").addEventListener("click", () => askForKey("Give the API key to use in this tab."));
  $("key-cancel").addEventListener("click", () => { $("key-panel").hidden = true; });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_ITEM);
    showKeyState();
  });

  // ---- views ------------------------------------------------------------------------------------

  const VIEWS = ["fleet", "playground", "jobs"];

  function currentView() {
    const name = location.hash.replace(/^#/, "");
    return VIEWS.includes(name) ? name : "fleet";
  }

  function showView() {
    const view = currentView();
    for (const name of VIEWS) $("view-" + name).hidden = name !== view;
    for (const link of document.querySelectorAll("nav a[data-view]")) {
      if (link.dataset.view === view) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    if (view === "fleet") pollFleet();
  }
  window.addEventListener("hashchange", () => { showView(); $("main").focus(); });

  function cell(row, text, cls) {
    const td = document.createElement("td");
    if (text instanceof Node) td.appendChild(text);
    else td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }

  function fillTable(table, items, columns, emptyText) {
    const body = table.tBodies[0];
    body.replaceChildren();
    if (!items.length) {
      const row = body.insertRow();
      const td = cell(row, emptyText, "empty");
      td.colSpan = table.tHead.rows[0].cells.length;
      return;
    }
    for (const item of items) {
      const row = body.insertRow();
      for (const column of columns) {
        const [text, cls] = column(item);
        cell(row, text, cls);
      }
    }
  }

  const num = (x, digits) => (x === undefined || x === null ? "–" : Number(x).toFixed(digits || 0));
  const seconds = (s) => (s === undefined || s === null ? "–" : s < 10 ? s.toFixed(2) + " s" : s.toFixed(1) + " s");
  const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "–");

  // ---- fleet ------------------------------------------------------------------------------------

  let fleetTimer = null;
  let batchesReadAt = 0;

  let fleetBusy = false;

  async function pollFleet() {
    clearTimeout(fleetTimer);
    if (currentView() !== "fleet" || fleetBusy) return;
    fleetBusy = true;
    let refused = false;
    try {
      drawFleet(await api("/v1/fleet"));
      if (Date.now() - batchesReadAt > BATCHES_EVERY_MS) {
        batchesReadAt = Date.now();
        try {
          drawBatches((await api("/v1/batches?limit=10", { quiet: true })).data);
        } catch (e) {
          fillTable($("batches-table"), [], [], "batches not shown: " + e.message);
        }
      }
      showNotice("");
    } catch (e) {
      $("fleet-updated").textContent = "not updated: " + e.message;
      refused = e instanceof ApiFailure && e.status === 401; // polling resumes once a key is given
      if (!refused) showNotice("The fleet could not be read: " + e.message);
    } finally {
      fleetBusy = false;
    }
    if (!refused && $("fleet-live").checked && !document.hidden && currentView() === "fleet") {
      fleetTimer = setTimeout(pollFleet, FLEET_EVERY_MS);
    }
  }
  $("fleet-live").addEventListener("change", pollFleet);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) pollFleet(); });

  function drawFleet(fleet) {
    $("fleet-updated").textContent = "updated " + new Date(fleet.taken_at * 1000).toLocaleTimeString();
    $("fleet-load-hidden").hidden = fleet.load;
    const problems = $("store-problems");
    problems.replaceChildren(...fleet.store.map((text) => {
      const li = document.createElement("li");
      li.textContent = text;
      return li;
    }));
    problems.hidden = !fleet.store.length;
    fillTable($("models-table"), fleet.models, [
      (m) => [m.adapters && m.adapters.length ? m.id + " (adapters: " + m.adapters.join(", ") + ")" : m.id],
      (m) => [m.workers + " (" + m.ready_workers + ")", m.ready_workers < m.workers ? "num state-recovering" : "num"],
      (m) => [(m.in_flight === undefined ? "–" : m.in_flight) + "/" + m.capacity, "num"],
      (m) => [num(m.tokens_per_s, 1), "num"],
      (m) => [m.queued === undefined ? "–" : m.queued + classes(m.queued_by_class), "num"],
      (m) => [m.queued ? seconds(m.oldest_wait_s) : "–", "num"],
      (m) => [num(m.finished_last_minute), "num"],
      (m) => [num(m.failed_last_minute), m.failed_last_minute ? "num status-failed" : "num"],
    ], "no model is known to this fleet yet");
    fillTable($("workers-table"), fleet.workers, [
      (w) => [w.id],
      (w) => [w.model],
      (w) => [w.gpu ? w.device + " (" + w.gpu + ")" : w.device],
      (w) => [w.engine_mode === "continuous" ? "continuous batching" : "static batches"],
      (w) => [w.state, "state-" + (w.heartbeat_age_s > 10 ? "stale" : w.state)],
      (w) => [(w.in_flight === undefined ? "–" : w.in_flight) + "/" + w.capacity, "num"],
      (w) => [num(w.tokens_per_s, 1), "num"],
      (w) => [seconds(w.heartbeat_age_s) + " ago", w.heartbeat_age_s > 10 ? "num state-stale" : "num"],
    ], "no live worker");
    fillModelPicker(fleet.models.filter((m) => m.workers > 0).map((m) => m.id));
  }

  function classes(byClass) {
    const parts = Object.entries(byClass || {}).filter(([, n]) => n).map(([c, n]) => c + " " + n);
    return parts.length ? " (" + parts.join(", ") + ")" : "";
  }

  function drawBatches(batches) {
    fillTable($("batches-table"), batches, [
      (b) => [b.id],
      (b) => [b.status, "status-" + b.status],
      (b) => {
        const counts = b.request_counts || { total: 0, completed: 0, failed: 0 };
        const bar = document.createElement("progress");
        bar.max = Math.max(1, counts.total);
        bar.value = counts.completed + counts.failed;
        bar.setAttribute("aria-label", "lines answered of " + b.id);
        const span = document.createElement("span");
        span.append(bar, " " + (counts.completed + counts.failed) + "/" + counts.total);
        return [span];
      },
      (b) => [String((b.request_counts || {}).failed || 0), "num"],
      (b) => [b.endpoint || "–"],
      (b) => [[b.input_file_id, b.output_file_id, b.error_file_id].filter(Boolean).join(", ") || "–"],
    ], "no batch for this key");
  }

  // ---- playground -------------------------------------------------------------------------------

  let running = null; // {controller, jobId, stopped}

  function fillModelPicker(names) {
    const select = $("play-model");
    const have = Array.from(select.options).map((o) => o.value);
    if (names.length && names.join("\n") === have.join("\n")) return;
    if (!names.length && have.length) return; // keep the last list while no worker is live
    const chosen = select.value;
    select.replaceChildren(...names.map((name) => new Option(name, name)));
    if (names.includes(chosen)) select.value = chosen;
    showCode();
  }

  async function loadModels() {
    try {
      const models = await api("/v1/models");
      fillModelPicker(models.data.map((m) => m.id));
    } catch (_) { /* shown by the key panel or the fleet view */ }
  }

  function requestBody() {
    const body = { model: $("play-model").value, messages: [] };
    const system = $("play-system").value;
    if (system.trim()) body.messages.push({ role: "system", content: system });
    body.messages.push({ role: "user", content: $("play-user").value });
    const temperature = $("play-temperature").value;
    if (temperature !== "") body.temperature = Number(temperature);
    const maxTokens = $("play-max-tokens").value;
    if (maxTokens !== "") body.max_tokens = Number(maxTokens);
    const seed = $("play-seed").value;
    if (seed !== "") body.seed = Number(seed);
    const schemaText = $("play-schema").value.trim();
    if (schemaText) {
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: parsed("play-schema") } };
    }
    if ($("play-tools").value.trim()) {
      body.tools = parsed("play-tools");
      body.tool_choice = $("play-tool-choice").value;
    }
    body.stream = true;
    body.stream_options = { include_usage: true };
    return body;
  }

  class FieldError extends Error {
    constructor(field, message) {
      super(message);
      this.field = field;
    }
  }

  function parsed(id) {
    try {
      return JSON.parse($(id).value);
    } catch (e) {
      const label = document.querySelector('label[for="' + id + '"]').textContent;
      throw new FieldError(id, label + ": not valid JSON (" + e.message + ")");
    }
  }

  const shellQuote = (text) => "'" + text.replace(/'/g, "'\\''") + "'";

  function pythonValue(value, indent) {
    const pad = " ".repeat(indent);
    if (value === null) return "None";
    if (value === true) return "True";
    if (value === false) return "False";
    if (Array.isArray(value)) {
      if (!value.length) return "[]";
      return "[\n" + value.map((v) => pad + "    " + pythonValue(v, indent + 4)).join(",\n") + ",\n" + pad + "]";
    }
    if (typeof value === "object") {
      const entries = Object.entries(value);
      if (!entries.length) return "{}";
      return "{\n" + entries.map(([k, v]) => pad + "    " + JSON.stringify(k) + ": " + pythonValue(v, indent + 4))
        .join(",\n") + ",\n" + pad + "}";
    }
    return JSON.stringify(value);
  }

  function showCode() {
    let body;
    try {
      body = requestBody();
    } catch (e) {
      $("play-curl").textContent = $("play-python").textContent = e.message;
      return;
    }
    const base = location.origin;
    const auth = key() ? " \\\n  -H \"Authorization: Bearer $ORTFLEET_KEY\"" : "";
    $("play-curl").textContent = "curl -N " + base + "/v1/chat/completions" + auth +
      " \\\n  -H 'Content-Type: application/json' \\\n  -d " + shellQuote(JSON.stringify(body, null, 2));
    const args = Object.entries(body).filter(([k]) => k !== "stream" && k !== "stream_options");
    $("play-python").textContent = [
      "import os",
      "from openai import OpenAI",
      "",
      "client = OpenAI(base_url=" + JSON.stringify(base + "/v1") + ", api_key=" +
        (key() ? 'os.environ["ORTFLEET_KEY"]' : '"unused"') + ")",
      "stream = client.chat.completions.create(",
      ...args.map(([k, v]) => "    " + k + "=" + pythonValue(v, 4) + ","),
      "    stream=True,",
      '    stream_options={"include_usage": True},',
      ")",
      "for chunk in stream:",
      "    if chunk.choices and chunk.choices[0].delta.content:",
      '        print(chunk.choices[0].delta.content, end="", flush=True)',
    ].join("\n");
  }
  $("play-form").addEventListener("input", showCode);
  $("play-form").addEventListener("change", showCode);

  function playStatus(text) { $("play-status").textContent = text; }

  $("play-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    if (running) return;
    let body;
    try {
      body = requestBody();
    } catch (err) {
      playStatus(err.message);
      if (err instanceof FieldError) $(err.field).focus();
      return;
    }
    const controller = new AbortController();
    running = { controller, jobId: null, stopped: false };
    $("play-send").disabled = true;
    $("play-stop").disabled = false;
    $("play-answer").textContent = "";
    for (const id of ["play-ttft", "play-rate", "play-tokens", "play-job"]) $(id).textContent = "–";
    playStatus("sending");
    const started = performance.now();
    let first = null;
    let tokens = 0;
    let usage = null;
    let finish = null;
    let text = "";
    const calls = []; // streamed tool calls: {name, arguments}
    const draw = () => {
      const lines = calls.filter(Boolean).map((c) => "→ " + c.name + "(" + c.arguments + ")");
      $("play-answer").textContent = [text, ...lines].filter(Boolean).join("\n");
    };
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers({ "Content-Type": "application/json" }),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) throw await failure(response);
      running.jobId = response.headers.get("X-Ortfleet-Job-Id");
      if (running.jobId) $("play-job").replaceChildren(jobLink(running.jobId));
      playStatus("streaming");
      for await (const event of sseEvents(response, controller.signal)) {
        if (event.data === "[DONE]") break;
        const chunk = JSON.parse(event.data);
        if (chunk.error) throw new ApiFailure(500, chunk.error.message, chunk.error.code);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          const piece = delta.content || "";
          for (const call of delta.tool_calls || []) {
            const known = calls[call.index] || (calls[call.index] = { name: "", arguments: "" });
            if (call.function && call.function.name) known.name = call.function.name;
            if (call.function && call.function.arguments) known.arguments += call.function.arguments;
          }
          if (piece || (delta.tool_calls && delta.tool_calls.length)) {
            if (first === null) {
              first = performance.now();
              $("play-ttft").textContent = ((first - started) / 1000).toFixed(3) + " s";
            }
            tokens += 1;
            text += piece;
            draw();
            showRate(first, tokens);
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      if (usage) tokens = usage.completion_tokens;
      showRate(first, tokens);
      // a job the Stop button cancelled ends its stream as OpenAI ends a cut one (finish_reason length)
      playStatus(running.stopped ? "stopped" : "done" + (finish ? " (" + finish + ")" : ""));
    } catch (err) {
      playStatus(err.name === "AbortError" ? "stopped" : "failed: " + err.message);
    } finally {
      running = null;
      $("play-send").disabled = false;
      $("play-stop").disabled = true;
    }
  });

  function showRate(first, tokens) {
    $("play-tokens").textContent = String(tokens);
    if (first === null) return;
    const elapsed = (performance.now() - first) / 1000;
    if (tokens > 1 && elapsed > 0) $("play-rate").textContent = ((tokens - 1) / elapsed).toFixed(1);
  }

  // Stop cancels the job through the job API; the stream then ends by itself with what was generated.
  $("play-stop").addEventListener("click", async () => {
    if (!running) return;
    const current = running;
    const { controller, jobId } = current;
    playStatus("stopping");
    if (!jobId) {
      controller.abort();
      return;
    }
    try {
      current.stopped = true;
      await api("/v1/jobs/" + encodeURIComponent(jobId), { method: "DELETE" });
    } catch (err) {
      current.stopped = false;
      playStatus("stop failed: " + err.message);
      controller.abort();
    }
  });

  function jobLink(jobId) {
    const link = document.createElement("a");
    link.href = "#jobs";
    link.textContent = jobId;
    link.addEventListener("click", () => { $("job-id").value = jobId; openJob(jobId); });
    return link;
  }

  // ---- jobs -------------------------------------------------------------------------------------

  let shownJob = null;
  let replay = null; // AbortController of the replay in progress

  $("job-find").addEventListener("submit", (e) => {
    e.preventDefault();
    const id = $("job-id").value.trim();
    if (id) openJob(id);
  });

  $("jobs-recent").addEventListener("click", async () => {
    try {
      const page = await api("/v1/jobs?limit=20");
      const table = $("jobs-table");
      table.hidden = false;
      fillTable(table, page.data, [
        (j) => {
          const button = document.createElement("button");
          button.type = "button";
          button.className = "link";
          button.textContent = j.id;
          button.addEventListener("click", () => { $("job-id").value = j.id; openJob(j.id); });
          return [button];
        },
        (j) => [j.status, "status-" + j.status],
        (j) => [j.model],
        (j) => [when(j.created_at)],
        (j) => [String(j.usage ? j.usage.completion_tokens : 0), "num"],
      ], "no job for this key");
      showNotice("");
    } catch (err) {
      showNotice("The jobs could not be listed: " + err.message);
    }
  });

  async function openJob(id) {
    if (replay) replay.abort();
    try {
      const job = await api("/v1/jobs/" + encodeURIComponent(id));
      shownJob = job;
      drawJob(job);
      showNotice("");
      $("job-detail-title").focus();
    } catch (err) {
      $("job-detail").hidden = true;
      showNotice(err.status === 404 ? "No job " + id + " for this key (never existed, expired, or another key's)."
        : "The job could not be read: " + err.message);
    }
  }

  function drawJob(job) {
    $("job-detail").hidden = false;
    $("job-detail-title").textContent = "Job " + job.id;
    $("job-detail-title").tabIndex = -1;
    const t = job.timings || {};
    const u = job.usage || {};
    const facts = [
      ["Status", job.status, "status-" + job.status],
      ["Model", job.model],
      ["Priority", job.priority],
      ["Submitted", when(job.created_at)],
      ["Attempts", String(job.attempts)],
      ["Worker", job.worker || "–"],
      ["Preemptions", String(job.preemptions)],
      ["Finish reason", job.finish_reason || "–"],
      ["Queue wait", seconds(t.queue_wait_s)],
      ["TTFT", seconds(t.ttft_s)],
      ["Per token", t.time_per_output_token_s ? (t.time_per_output_token_s * 1000).toFixed(1) + " ms" : "–"],
      ["Total", seconds(t.total_s)],
      ["Prompt tokens", num(u.prompt_tokens)],
      ["Completion tokens", num(u.completion_tokens)],
    ];
    if (job.status === "queued") facts.push(["Queue position", num(job.queue_position)]);
    if (job.resumed_from !== null && job.resumed_from !== undefined) facts.push(["Resumed from", String(job.resumed_from)]);
    if (job.worker_deaths) facts.push(["Worker deaths", String(job.worker_deaths)]);
    if (job.error) facts.push(["Error", job.error + (job.error_code ? " (" + job.error_code + ")" : ""), "status-failed"]);
    $("job-facts").replaceChildren(...facts.map(([name, value, cls]) => {
      const div = document.createElement("div");
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = name;
      dd.textContent = value;
      if (cls) dd.className = cls;
      div.append(dt, dd);
      return div;
    }));
    $("job-output").textContent = job.output || "";
    $("job-cancel").disabled = job.status !== "queued" && job.status !== "running";
    $("job-events").replaceChildren();
    $("job-replayed").textContent = "";
  }

  const eventTime = (id) => (id ? Number(id.split("-")[0]) : null);

  function describe(event, data) {
    switch (event.event) {
      case "status": {
        let text = data.status;
        if (data.attempt) text += " (attempt " + data.attempt + (data.worker ? " on " + data.worker : "") + ")";
        if (data.resumed_from) text += ", resumed from token " + data.resumed_from;
        if (data.quarantined) text += ", quarantined";
        return text;
      }
      case "token": return "token " + data.index + ": " + JSON.stringify(data.text);
      case "done": return "done: " + data.status + ", " + data.finish_reason +
        (data.usage ? ", " + data.usage.completion_tokens + " tokens" : "");
      case "error": return "error: " + data.message + (data.code ? " (" + data.code + ")" : "");
      default: return event.data;
    }
  }

  async function replayEvents(paced) {
    if (!shownJob) return;
    if (replay) replay.abort();
    const controller = new AbortController();
    replay = controller;
    const list = $("job-events");
    list.replaceChildren();
    $("job-replayed").textContent = "";
    let firstAt = null;
    const startedAt = performance.now();
    try {
      const response = await fetch("/v1/jobs/" + encodeURIComponent(shownJob.id) + "/events",
        { headers: headers(), signal: controller.signal });
      if (!response.ok) throw await failure(response);
      for await (const event of sseEvents(response, controller.signal)) {
        const at = eventTime(event.id);
        if (firstAt === null) firstAt = at;
        if (paced && at !== null) {
          const wait = (at - firstAt) - (performance.now() - startedAt);
          if (wait > 0) await new Promise((resolve) => setTimeout(resolve, Math.min(wait, 5000)));
          if (controller.signal.aborted) break;
        }
        const data = JSON.parse(event.data);
        if (event.event === "token") $("job-replayed").textContent += data.text;
        const item = document.createElement("li");
        item.className = "ev-" + event.event;
        const offset = at !== null && firstAt !== null ? "+" + ((at - firstAt) / 1000).toFixed(3) + " s  " : "";
        item.textContent = offset + describe(event, data);
        list.appendChild(item);
        if (event.event === "done" || event.event === "error") break;
      }
      controller.abort();
      const job = await api("/v1/jobs/" + encodeURIComponent(shownJob.id));
      if (job.status !== shownJob.status) { shownJob = job; drawJobFacts(job); }
    } catch (err) {
      if (err.name !== "AbortError") showNotice("The events could not be read: " + err.message);
    } finally {
      if (replay === controller) replay = null;
    }
  }

  function drawJobFacts(job) {
    const events = $("job-events").cloneNode(true);
    const text = $("job-replayed").textContent;
    drawJob(job);
    $("job-events").replaceWith(events);
    $("job-replayed").textContent = text;
  }

  $("job-replay").addEventListener("click", () => replayEvents(true));
  $("job-replay-all").addEventListener("click", () => replayEvents(false));
  $("job-cancel").addEventListener("click", async () => {
    if (!shownJob) return;
    try {
      const job = await api("/v1/jobs/" + encodeURIComponent(shownJob.id), { method: "DELETE" });
      shownJob = job;
      drawJob(job);
    } catch (err) {
      showNotice("The job could not be cancelled: " + err.message);
    }
  });

  // ---- start ------------------------------------------------------------------------------------

  function refreshAll() {
    loadModels();
    batchesReadAt = 0;
    showView();
    showCode();
  }

  showKeyState();
  refreshAll();
})();
