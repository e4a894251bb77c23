// The operations view: the workers table (admin API, else /health) with drain, undrain,
// restart and rolling restart, live charts from /metrics, and an event log.

import { ApiError, call, getJson, keys } from "./api.js";
import { $, el } from "./dom.js";
import { LineChart } from "./charts.js";
import { parsePrometheus, quantileBetween } from "./metrics.js";

const P = "zeroserve:";
const DEADLINE_S = 30;
const QUANTILE_WINDOW_MS = 10_000; // latency percentiles over the last 10 s of requests
const ADMIN_RETRY_MS = 30_000; // after a refusal, ask the admin API again this often
const GONE_AFTER_MS = 120_000; // a worker absent this long is no longer "restarting"
const RESTARTED_BADGE_MS = 30_000;
const POLL_TIMEOUT_MS = 5000; // a stalled gateway makes the table stale, not the page stuck

function clock(t = Date.now()) {
  return new Date(t).toLocaleTimeString([], { hour12: false });
}

// The box's KV tier of one worker as its table cell shows it: "off", or "on" with the
// blocks loaded from it (hits) and the lookups that found nothing there (misses) since the
// worker started; the tier's id and its other figures in the tooltip. `w` is a worker as
// /admin/workers and /health describe it (kv_tier_id: the tier it shares; kv_tier: its
// counters, null before its first report).
export function tierCell(w) {
  const tier = w.kv_tier || null;
  if (!w.kv_tier_id && !tier) return { state: "off", text: "off", title: "No KV tier (--kv-offloading-size 0)." };
  const hits = tier?.hits ?? 0;
  const misses = tier?.misses ?? 0;
  const mib = (bytes) => `${((bytes ?? 0) / 2 ** 20).toFixed(1)} MiB`;
  const title = [
    `KV tier ${w.kv_tier_id ?? "(id not reported)"}`,
    `${hits} blocks loaded, ${misses} lookups missed`,
    `${mib(tier?.read_bytes)} read, ${mib(tier?.written_bytes)} written`,
    `${tier?.evictions ?? 0} evicted, ${((tier?.load_microseconds ?? 0) / 1000).toFixed(1)} ms loading`,
  ].join("\n");
  return { state: "on", text: `on · ${hits} hits / ${misses} misses`, title, hits, misses };
}

export class OpsView {
  constructor({ confirm }) {
    this.confirm = confirm;
    this.known = new Map(); // worker id -> {info, lastSeen, incarnation, pid, restartedAt, restarts, restartPending}
    this.isAdmin = null; // null: not asked yet
    this.adminRefusedAt = 0;
    this.adminRefusal = "";
    this.metricsNote = "";
    this.workersNote = "";
    this.scrapes = []; // recent scrapes, oldest first
    this.lastUpdate = 0;
    this.isRolling = false;
    this.charts = {
      tokens: new LineChart($("chart-tokens"), { title: "Generated tokens/s", series: ["tokens/s"], minMax: 10 }),
      requests: new LineChart($("chart-requests"), { title: "Requests", series: ["running", "queued"], minMax: 4 }),
      ttft: new LineChart($("chart-ttft"), { title: "Time to first token", series: ["p50", "p99"], unit: "ms", minMax: 10 }),
      itl: new LineChart($("chart-itl"), { title: "Inter-token latency", series: ["p50", "p99"], unit: "ms", minMax: 10 }),
      lag: new LineChart($("chart-lag"), { title: "Event-loop lag", series: ["p99", "max"], unit: "ms", minMax: 10 }),
    };
    $("rolling-restart").addEventListener("click", () => this.rollingRestart());
    window.addEventListener("resize", () => this.drawCharts());
  }

  start() {
    const loop = async () => {
      if (document.visibilityState === "visible" || !this.lastUpdate) {
        this.renderNotes(Date.now()); // "stale" shows while a refresh is still waiting
        await this.tick();
      }
      setTimeout(loop, 1000);
    };
    loop();
  }

  keysChanged() {
    this.isAdmin = null;
    this.adminRefusedAt = 0;
  }

  // One refresh at a time: the timer, a tab switch and an action may all ask for one.
  tick() {
    if (!this.inFlight) this.inFlight = this.refresh().finally(() => { this.inFlight = null; });
    return this.inFlight;
  }

  async refresh() {
    const [workers, metrics] = await Promise.allSettled([this.fetchWorkers(), this.fetchMetrics()]);
    const now = Date.now();
    if (workers.status === "fulfilled") {
      this.updateWorkers(workers.value, now);
      this.lastUpdate = now;
    }
    if (metrics.status === "fulfilled" && metrics.value) {
      this.updateCharts(metrics.value);
      this.renderClasses(metrics.value);
    }
    this.renderTable(now);
    this.renderNotes(now);
    this.drawCharts();
  }

  // The gateway queue's priority classes (docs/operations/priority-and-fairness.md): share,
  // requests queued now and shed so far, from the /metrics scrape.
  renderClasses(scrape) {
    const table = document.getElementById("classes");
    const shares = scrape.select("zeroserve:priority_class_share");
    table.hidden = !shares.length;
    table.tBodies[0].replaceChildren(...shares.map((share) => {
      const where = { priority_class: share.labels.priority_class };
      const cells = [
        [share.labels.priority_class, ""], [String(share.value), "num"],
        [String(scrape.sum("zeroserve:gateway_queue_requests", where) ?? 0), "num"],
        [String(scrape.sum("zeroserve:gateway_shed_requests_total", where) ?? 0), "num"],
      ];
      const row = document.createElement("tr");
      for (const [text, className] of cells) {
        const cell = document.createElement("td");
        cell.textContent = text;
        cell.className = className;
        row.append(cell);
      }
      return row;
    }));
  }

  // --- data -------------------------------------------------------------------------------

  async fetchWorkers() {
    const mayAskAdmin = this.isAdmin !== false || Date.now() - this.adminRefusedAt > ADMIN_RETRY_MS;
    if (mayAskAdmin) {
      try {
        const body = await getJson("/admin/workers", "admin", POLL_TIMEOUT_MS);
        if (this.isAdmin === false) this.event("Admin API available: worker actions enabled.");
        this.isAdmin = true;
        this.workersNote = "";
        return body.workers;
      } catch (err) {
        if (!(err instanceof ApiError) || ![401, 403, 404].includes(err.status)) throw err;
        this.isAdmin = false;
        this.adminRefusedAt = Date.now();
        this.adminRefusal = `${err.status}: ${err.detail || "refused"}`;
      }
    }
    return this.fetchHealthWorkers();
  }

  // Read-only: /health lists workers to a caller with an API key (to all when none is set);
  // it answers 503, with the same body, while no worker is ready.
  async fetchHealthWorkers() {
    const headers = { Accept: "application/json" };
    if (keys.get("api")) headers.Authorization = `Bearer ${keys.get("api")}`;
    let response;
    try {
      response = await fetch("/health", {
        headers, cache: "no-store", credentials: "omit", signal: AbortSignal.timeout(POLL_TIMEOUT_MS),
      });
    } catch {
      throw new ApiError(0, "The gateway does not answer.");
    }
    const body = await response.json().catch(() => ({}));
    this.workersNote = Array.isArray(body.workers) ? ""
      : "The workers table needs an API key (or an admin key): enter one under Keys.";
    return body.workers || [];
  }

  async fetchMetrics() {
    try {
      const response = await call("/metrics", { key: "api", timeoutMs: POLL_TIMEOUT_MS });
      const scrape = parsePrometheus(await response.text());
      this.metricsNote = "";
      return scrape;
    } catch (err) {
      if (err instanceof ApiError && err.status !== 0) {
        this.metricsNote = err.status === 404
          ? "The charts need GET /metrics, which this gateway does not serve (--disable-metrics)."
          : `The charts need GET /metrics: ${err.message}`;
      }
      return null;
    }
  }

  updateWorkers(list, now) {
    const present = new Set();
    for (const info of list) {
      const id = info.worker_id;
      present.add(id);
      const known = this.known.get(id);
      if (!known) {
        this.known.set(id, { info, lastSeen: now, incarnation: info.incarnation, pid: info.pid, restarts: 0 });
        if (this.lastUpdate) this.event(`${id} joined (pid ${info.pid}).`);
        continue;
      }
      if (known.incarnation && info.incarnation && known.incarnation !== info.incarnation) {
        known.restarts += 1;
        known.restartedAt = now;
        known.restartPending = 0;
        this.event(`${id} restarted: pid ${known.pid} → ${info.pid}.`, "warn");
        if (!this.hasMetrics) this.markAll(`restart ${id}`, "#7a56d6");
      } else if (known.absentSince) {
        this.event(`${id} is back (pid ${info.pid}).`);
      }
      Object.assign(known, { info, lastSeen: now, incarnation: info.incarnation, pid: info.pid, absentSince: null });
    }
    for (const [id, known] of this.known) {
      if (present.has(id)) continue;
      if (!known.absentSince) {
        known.absentSince = now;
        this.event(`${id} is not connected: restarting or lost.`, "bad");
      } else if (now - known.absentSince > 10 * GONE_AFTER_MS) {
        this.known.delete(id);
      }
    }
  }

  // What a row shows as its status: [css class, text].
  statusOf(known, now) {
    if (known.absentSince) {
      return now - known.absentSince < GONE_AFTER_MS ? ["restarting", "restarting (not connected)"] : ["gone", "gone"];
    }
    const status = known.info.status;
    if (known.restartPending && now - known.restartPending > (DEADLINE_S + 120) * 1000) {
      known.restartPending = 0; // it never came back as a new process: show what it is
    }
    if (known.restartPending) return ["restarting", `restarting (${status})`];
    return [status, status];
  }

  // --- charts -----------------------------------------------------------------------------

  get hasMetrics() {
    return this.scrapes.length > 0 && !this.metricsNote;
  }

  updateCharts(scrape) {
    const previous = this.scrapes.at(-1);
    this.scrapes.push(scrape);
    while (this.scrapes.length > 2 && scrape.at - this.scrapes[1].at > QUANTILE_WINDOW_MS) this.scrapes.shift();
    this.latest = scrape;
    if (!previous) return;
    const t = scrape.at;
    const dt = (t - previous.at) / 1000;
    const tokens = (scrape.sum(`${P}generation_tokens_total`) ?? 0) - (previous.sum(`${P}generation_tokens_total`) ?? 0);
    this.charts.tokens.push(t, [tokens >= 0 && dt > 0 ? tokens / dt : null]);
    const queued = (scrape.sum(`${P}num_requests_waiting`) ?? 0) + (scrape.sum(`${P}num_requests_queued_gateway`) ?? 0);
    this.charts.requests.push(t, [scrape.sum(`${P}num_requests_running`) ?? 0, queued]);
    const oldest = this.scrapes[0];
    const ms = (v) => (v === null ? null : v * 1000);
    for (const [chart, name] of [["ttft", "time_to_first_token_seconds"], ["itl", "inter_token_latency_seconds"]]) {
      this.charts[chart].push(t, [0.5, 0.99].map((q) => ms(quantileBetween(oldest, scrape, P + name, q))));
    }
    const lag = (q) => ms(scrape.max(`${P}event_loop_lag_seconds`, { quantile: q }));
    this.charts.lag.push(t, [lag("0.99"), lag("1.0")]);
    // Marks: failovers and worker restarts or losses since the last scrape.
    const failovers = (scrape.sum(`${P}failovers_total`) ?? 0) - (previous.sum(`${P}failovers_total`) ?? 0);
    if (failovers > 0) {
      this.markAll(`failover ×${failovers}`, "#e07a1f");
      this.event(`${failovers} stream${failovers > 1 ? "s" : ""} failed over to another worker.`, "warn");
    }
    const before = previous.byLabel(`${P}worker_events_total`, "worker_id");
    for (const [id, count] of scrape.byLabel(`${P}worker_events_total`, "worker_id")) {
      if (count > (before.get(id) || 0)) this.markAll(`restart ${id}`, "#7a56d6");
    }
  }

  markAll(label, color) {
    const t = Date.now();
    for (const chart of Object.values(this.charts)) chart.mark(t, label, color);
  }

  drawCharts() {
    if ($("view-ops").hidden) return;
    for (const chart of Object.values(this.charts)) chart.draw();
  }

  // --- rendering --------------------------------------------------------------------------

  renderNotes(now) {
    const notes = [];
    if (this.isAdmin === false) {
      notes.push(`Read-only: the admin API refused this console (${this.adminRefusal}). Enter an admin key under Keys to drain and restart workers.`);
    }
    if (this.workersNote) notes.push(this.workersNote);
    if (this.metricsNote) notes.push(this.metricsNote);
    const box = $("ops-note");
    box.textContent = notes.join(" ");
    box.hidden = notes.length === 0;
    $("rolling-restart").hidden = this.isAdmin !== true;
    $("rolling-restart").disabled = this.isRolling;
    const age = Math.round((now - this.lastUpdate) / 1000);
    $("ops-updated").textContent = !this.lastUpdate ? "waiting for the gateway…"
      : age <= 3 ? `live · updated ${clock(this.lastUpdate)}` : `stale · last update ${age} s ago`;
  }

  renderTable(now) {
    const body = $("workers").tBodies[0];
    const rows = [...this.known.entries()].sort(([a], [b]) => a.localeCompare(b, undefined, { numeric: true }))
      .map(([id, known]) => this.row(id, known, now));
    if (!rows.length) {
      const row = el("tr", "empty-row");
      const cell = el("td", "", this.lastUpdate ? "No worker is connected." : "Loading…");
      cell.colSpan = 13;
      row.append(cell);
      rows.push(row);
    }
    body.replaceChildren(...rows);
  }

  row(id, known, now) {
    const w = known.info;
    const row = el("tr");
    row.dataset.worker = id;
    const [cls, text] = this.statusOf(known, now);
    const status = el("td");
    const label = el("span", `status status-${cls}`, text);
    label.dataset.status = cls;
    status.append(label);
    if (known.restartedAt && now - known.restartedAt < RESTARTED_BADGE_MS) {
      status.append(el("span", "badge", `restarted ${Math.round((now - known.restartedAt) / 1000)} s ago`));
    }
    const kv = el("td");
    if (w.num_total_blocks > 0) {
      const used = (w.num_total_blocks - w.num_free_blocks) / w.num_total_blocks;
      const bar = el("span", "bar");
      const fill = el("span");
      fill.style.width = `${Math.round(used * 100)}%`;
      bar.append(fill);
      const box = el("span", "kv");
      box.append(bar, `${(used * 100).toFixed(1)}%`);
      kv.append(box);
    } else {
      kv.textContent = "–";
    }
    const cells = [
      el("td", "", id), status, el("td", "", String(w.pid ?? "–")), el("td", "", w.device ?? "–"),
      el("td", "", w.served_model_name ? `${w.served_model_name}@${w.version}` : "–"),
      el("td", "num", String(w.num_running ?? 0)), el("td", "num", String(w.num_waiting ?? 0)),
      el("td", "num", String(w.num_paused ?? 0)), kv,
      el("td", "num", this.prefixHitRate(id)), this.tierTd(w),
      el("td", "num", String(this.restarts(id, known))),
    ];
    cells[0].className = "mono";
    const actions = el("td", "actions");
    if (this.isAdmin === true && !known.absentSince) {
      if (w.status === "draining") actions.append(this.button("Undrain", () => this.act(id, "undrain")));
      else actions.append(this.button("Drain", () => this.act(id, "drain")));
      actions.append(this.button("Restart", () => this.act(id, "restart"), known.restartPending || this.isRolling));
    }
    row.append(...cells, actions);
    return row;
  }

  tierTd(w) {
    const { state, text, title } = tierCell(w);
    const cell = el("td", state === "off" ? "muted" : "", text);
    cell.dataset.tier = state;
    cell.title = title;
    return cell;
  }

  prefixHitRate(id) {
    if (!this.latest) return "–";
    const queries = this.latest.sum(`${P}prefix_cache_queries_total`, { worker_id: id });
    const hits = this.latest.sum(`${P}prefix_cache_hits_total`, { worker_id: id });
    return queries > 0 ? `${((100 * hits) / queries).toFixed(1)}%` : "–";
  }

  restarts(id, known) {
    const counted = this.latest?.sum(`${P}worker_events_total`, { worker_id: id }) ?? 0;
    return Math.max(counted, known.restarts);
  }

  button(label, handler, disabled = false) {
    const button = el("button", "btn btn-small", label);
    button.dataset.action = label.toLowerCase();
    button.disabled = disabled;
    button.addEventListener("click", handler);
    return button;
  }

  // --- actions ----------------------------------------------------------------------------

  async act(id, action) {
    const what = {
      drain: [`Drain ${id}?`, `${id} takes no new requests; its streams finish, or move to another worker after ${DEADLINE_S} s.`],
      undrain: [`Undrain ${id}?`, `${id} takes new requests again.`],
      restart: [`Restart ${id}?`, `${id} drains (streams move to another worker after ${DEADLINE_S} s at most), exits and is started again by its supervisor.`],
    }[action];
    if (!(await this.confirm(...what, action === "undrain" ? "Undrain" : action === "drain" ? "Drain" : "Restart"))) return;
    await this.send(id, action);
  }

  async send(id, action) {
    try {
      const body = action === "undrain" ? {} : { deadline_s: DEADLINE_S };
      await call(`/admin/workers/${encodeURIComponent(id)}/${action}`,
        { method: "POST", body, key: "admin", timeoutMs: 15_000 });
      this.event(`${action} ${id}: sent.`);
      const known = this.known.get(id);
      if (action === "restart" && known) known.restartPending = Date.now();
      await this.tick();
      return true;
    } catch (err) {
      this.event(`${action} ${id} failed: ${err.message}`, "bad");
      if (err instanceof ApiError && [401, 403].includes(err.status)) this.keysChanged();
      return false;
    }
  }

  async rollingRestart() {
    const ids = [...this.known.keys()].filter((id) => !this.known.get(id).absentSince).sort();
    if (!ids.length || this.isRolling) return;
    const ok = await this.confirm("Rolling restart?",
      `Restart ${ids.join(", ")} one at a time: each drains, restarts and must be ready again before the next.`, "Restart all");
    if (!ok) return;
    this.isRolling = true;
    this.event(`Rolling restart of ${ids.length} worker${ids.length > 1 ? "s" : ""} started.`);
    try {
      for (const id of ids) {
        const before = this.known.get(id)?.incarnation;
        if (!(await this.send(id, "restart"))) return;
        const deadline = Date.now() + (DEADLINE_S + 120) * 1000;
        while (Date.now() < deadline) {
          await new Promise((resolve) => setTimeout(resolve, 500));
          const known = this.known.get(id);
          if (known && !known.absentSince && known.incarnation !== before && known.info.status === "ready") break;
        }
        if (this.known.get(id)?.incarnation === before) {
          this.event(`Rolling restart stopped: ${id} was not ready again in time.`, "bad");
          return;
        }
      }
      this.event("Rolling restart done: every worker is a new process.");
    } finally {
      this.isRolling = false;
    }
  }

  event(text, level = "") {
    const list = $("events");
    const item = el("li", level);
    item.append(el("time", "", clock()), text);
    list.prepend(item);
    while (list.children.length > 200) list.lastChild.remove();
  }
}
