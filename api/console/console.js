// The kvstore console: sign in with an API key, then the owner's sessions, one session's detail and
// actions, the store's disk use and recent jobs — all through the service's JSON API.

import { drawStore, PARTS } from "./chart.js";
import { h, put } from "./dom.js";
import { ago, bytes, count, iso, plural, when } from "./format.js";

const KEY_NAME = "kvstore.console.key";
const JOB_POLL_MS = 1000;
// How long a job this page started (or saw running) may be missing from an answer before it is
// forgotten: an answer sent before the job began does not list it.
const PENDING_UNLISTED_MS = 30000;
const PAGE = 100; // sessions per page of GET /sessions; "Show more" asks for the next one

const $ = (id) => document.getElementById(id);

const state = {
  key: sessionStorage.getItem(KEY_NAME),
  owner: null,
  sessions: [],
  moreCursor: null, // next_cursor after the sessions shown (null: every session is shown)
  wanted: PAGE, // how many sessions the table shows at least (a refresh reads that many again)
  activity: {},
  store: null,
  jobs: [],
  // ids of jobs seen queued or running (or just started here) whose end this page has not acted on:
  // whichever answer shows one done first — a poll or a refresh — refreshes the page for it
  pending: new Map(), // job id -> when it was added (ms)
  selected: null,
  jobTimer: null,
  lastStore: null,
};

class ApiError extends Error {
  constructor(status, error, reason) {
    super(reason || error || `HTTP ${status}`);
    this.status = status;
    this.error = error;
  }
}

function describe(err) {
  return err instanceof ApiError ? `${err.error}: ${err.message}` : `Request failed: ${err.message}`;
}

/** Call the API with the signed-in key; the JSON answer, or the raw response with ``raw``. */
async function api(path, { method = "GET", body, key = state.key, raw = false } = {}) {
  const headers = { Authorization: `Bearer ${key}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: "no-store",
  });
  if (!response.ok) {
    let answer = {};
    try {
      answer = await response.json();
    } catch {
      answer = {};
    }
    const err = new ApiError(response.status, answer.error || `HTTP ${response.status}`, answer.reason || response.statusText);
    if (response.status === 401 && key === state.key && state.owner !== null) {
      signOut("The server no longer accepts this key (revoked or expired?). Sign in again.");
    }
    throw err;
  }
  if (raw) return response;
  return response.status === 204 ? null : response.json();
}

function flash(text, kind = "info") {
  const el = $("flash");
  el.className = `flash ${kind}`;
  put(el, text);
}

// ---------------------------------------------------------------------------- sign in / out
async function signIn(event) {
  event.preventDefault();
  const input = $("api-key");
  const key = input.value.trim();
  const error = $("signin-error");
  put(error);
  if (!key) {
    put(error, "Enter an API key.");
    input.setAttribute("aria-invalid", "true");
    input.focus();
    return;
  }
  const button = $("signin-button");
  button.disabled = true;
  try {
    const me = await api("/console/me", { key });
    state.key = key;
    sessionStorage.setItem(KEY_NAME, key);
    input.value = "";
    input.removeAttribute("aria-invalid");
    await enter(me, true);
  } catch (err) {
    put(error, err instanceof ApiError && err.status === 401 ? "This key is not accepted." : describe(err));
    input.setAttribute("aria-invalid", "true");
    input.focus();
  } finally {
    button.disabled = false;
  }
}

function signOut(message = "") {
  sessionStorage.removeItem(KEY_NAME);
  Object.assign(state, {
    key: null, owner: null, sessions: [], moreCursor: null, wanted: PAGE, activity: {}, store: null, jobs: [], selected: null,
    pending: new Map(),
  });
  clearTimeout(state.jobTimer);
  $("app").hidden = true;
  $("who").hidden = true;
  $("signin").hidden = false;
  put($("signin-error"), message);
  $("api-key").focus();
}

async function enter(me, moveFocus) {
  state.owner = me.owner;
  put($("who-owner"), `Signed in as ${me.owner}`);
  $("who").hidden = false;
  $("signin").hidden = true;
  $("app").hidden = false;
  await refresh();
  if (moveFocus) $("sessions-title").focus();
}

// ---------------------------------------------------------------------------- loading
/** The owner's sessions, oldest first, a page at a time until ``state.wanted`` are read (or all). */
async function loadSessions() {
  let sessions = [];
  let cursor = null;
  do {
    const query = `limit=${PAGE}` + (cursor === null ? "" : `&cursor=${encodeURIComponent(cursor)}`);
    const page = await api(`/sessions?${query}`);
    sessions = sessions.concat(page.sessions);
    cursor = page.next_cursor;
  } while (cursor !== null && sessions.length < state.wanted);
  return { sessions, cursor };
}

async function refresh() {
  const [sessions, activity, store, jobs] = await Promise.all([
    loadSessions(),
    api("/console/activity"),
    api("/console/store"),
    api("/jobs"),
  ]);
  state.sessions = sessions.sessions;
  state.moreCursor = sessions.cursor;
  state.activity = activity.sessions;
  state.store = store;
  state.jobs = jobs;
  const finished = settle(jobs);
  renderSessions();
  renderStore();
  renderJobs();
  await showSelected();
  // the sessions were read beside the jobs, maybe before a job's end: read them again after it
  if (finished.length) await refresh();
}

/** Jobs of ``jobs`` that ended since this page last looked (flashed once each); the others that
 * run are remembered. An id the answer does not list is kept a while (the answer may predate the
 * job: a refresh sent before it started), then forgotten (the server keeps recent jobs only). */
function settle(jobs) {
  const listed = new Set(jobs.map((j) => j.id));
  const finished = jobs.filter((j) => (j.state === "done" || j.state === "failed") && state.pending.has(j.id));
  const now = Date.now();
  for (const [id, since] of [...state.pending]) {
    if (!listed.has(id) && now - since > PENDING_UNLISTED_MS) state.pending.delete(id);
  }
  for (const job of finished) {
    state.pending.delete(job.id);
    flash(job.state === "done" ? `${job.kind} of ${job.session_id} finished.` : `${job.kind} of ${job.session_id} failed: ${job.error?.reason}`, job.state === "done" ? "info" : "error");
  }
  for (const job of jobs) {
    if ((job.state === "queued" || job.state === "running") && !state.pending.has(job.id)) state.pending.set(job.id, now);
  }
  return finished;
}

async function refreshQuietly() {
  try {
    await refresh();
  } catch (err) {
    if (state.owner !== null) flash(describe(err), "error");
  }
}

// ---------------------------------------------------------------------------- sessions
function verifyStatus(session) {
  if (session.state === "damaged") return h("span", { class: "badge bad" }, "damaged");
  const last = state.activity[session.id]?.last_verify;
  if (!last) return h("span", { class: "muted" }, "not verified");
  return last.ok
    ? h("span", { class: "badge good", title: when(last.time) }, `ok · ${ago(last.time)}`)
    : h("span", { class: "badge bad", title: when(last.time) }, `bad from record ${count(last.damaged_from)}`);
}

function cell(label, ...children) {
  return h("td", { "data-label": label }, ...children);
}

function renderSessions() {
  const holder = $("sessions");
  if (state.sessions.length === 0) {
    put(holder, h("p", { class: "muted" }, "No sessions yet. Create one through the API (docs/API.md) or an engine."));
    return;
  }
  const rows = state.sessions.map((session) =>
    h(
      "tr",
      { "aria-current": session.id === state.selected ? "true" : null },
      h(
        "th",
        { scope: "row", "data-label": "Session" },
        h("a", { href: `#session=${encodeURIComponent(session.id)}`, class: "session-link" }, session.id),
        session.tags.length ? h("span", { class: "tags" }, session.tags.join(" ")) : null,
      ),
      cell("State", h("span", { class: `badge state-${session.state}` }, session.state)),
      cell("Tier", session.tier.name),
      cell(
        "Tokens",
        count(session.n_records),
        session.watermark !== session.n_records ? h("span", { class: "muted" }, ` (${count(session.watermark)} resumable)`) : null,
      ),
      cell("Size", bytes(session.size_bytes)),
      cell("Last use", h("time", { datetime: iso(session.last_used), title: when(session.last_used) }, ago(session.last_used))),
      cell("Verify", verifyStatus(session)),
    ),
  );
  put(
    holder,
    h(
      "table",
      { class: "grid sessions" },
      h("caption", { class: "visually-hidden" }, `Sessions of ${state.owner}`),
      h(
        "thead",
        {},
        h("tr", {}, ...["Session", "State", "Tier", "Tokens", "Size", "Last use", "Verify"].map((t) => h("th", { scope: "col" }, t))),
      ),
      h("tbody", {}, rows),
    ),
    state.moreCursor === null
      ? null
      : h(
          "p",
          { class: "more" },
          h("button", { type: "button", id: "more-sessions", class: "quiet" }, "Show more sessions"),
          h("span", { class: "muted" }, ` ${plural(state.sessions.length, "session")} shown, oldest first`),
        ),
  );
}

async function showMoreSessions() {
  const page = await api(`/sessions?limit=${PAGE}&cursor=${encodeURIComponent(state.moreCursor)}`);
  state.sessions = state.sessions.concat(page.sessions);
  state.moreCursor = page.next_cursor;
  state.wanted = state.sessions.length;
  renderSessions();
}

// ---------------------------------------------------------------------------- store chart
function renderStore() {
  if (!state.store) return;
  const drawn = drawStore($("store-chart"), state.store);
  const store = state.store;
  const figures = [
    ["Used", `${bytes(store.used_bytes)}`],
    ["Budget", store.budget_bytes === null ? "none set" : bytes(store.budget_bytes)],
    ["Hard limit", store.hard_limit_bytes === null ? "none set" : bytes(store.hard_limit_bytes)],
    ...PARTS.map((p) => [p.label, `${bytes(store.store[p.state].bytes)} · ${plural(store.store[p.state].sessions, "session")}`, p.css]),
    ["Reserved by writes", bytes(store.reserved_bytes), "seg-reserved"],
    ...Object.entries(store.mine_by_tier).map(([tier, c]) => [`Yours, ${tier}`, `${bytes(c.bytes)} · ${plural(c.sessions, "session")}`]),
  ];
  put(
    $("store-figures"),
    figures.map(([term, value, css]) =>
      h("div", {}, h("dt", {}, css ? h("span", { class: `swatch ${css}`, "aria-hidden": "true" }) : null, term), h("dd", {}, value)),
    ),
  );
  state.lastStore = drawn.summary;
}

// ---------------------------------------------------------------------------- jobs
function jobProgress(job) {
  const fraction = typeof job.fraction === "number" ? job.fraction : job.total > 0 ? job.done / job.total : job.state === "done" ? 1 : 0;
  const percent = Math.round(fraction * 100);
  const label = `${job.kind} of ${job.session_id}`;
  return h(
    "span",
    { class: "progress" },
    h("progress", { max: 100, value: percent, "aria-label": `Progress of ${label}` }),
    ` ${percent}%`,
    // bytes where the service reports them (bytes_done/bytes_total), else its own units
    typeof job.bytes_total === "number" && job.bytes_total > 0
      ? h("span", { class: "muted" }, ` (${bytes(job.bytes_done)} / ${bytes(job.bytes_total)})`)
      : job.total > 0
        ? h("span", { class: "muted" }, ` (${count(job.done)} / ${count(job.total)})`)
        : null,
  );
}

function renderJobs() {
  const holder = $("jobs");
  const jobs = [...state.jobs].sort((a, b) => b.created - a.created).slice(0, 10);
  if (jobs.length === 0) {
    put(holder, h("p", { class: "muted" }, "No jobs yet: park, unpark and migrate run as jobs."));
  } else {
    put(
      holder,
      h(
        "table",
        { class: "grid jobs" },
        h("caption", { class: "visually-hidden" }, "Recent jobs, newest first"),
        h("thead", {}, h("tr", {}, ...["Job", "Session", "State", "Progress", "Started"].map((t) => h("th", { scope: "col" }, t)))),
        h(
          "tbody",
          {},
          jobs.map((job) =>
            h(
              "tr",
              {},
              cell("Job", job.kind),
              cell("Session", job.session_id),
              cell(
                "State",
                h("span", { class: `badge job-${job.state}` }, job.state),
                job.error ? h("span", { class: "error-text" }, ` ${job.error.error}: ${job.error.reason}`) : null,
              ),
              cell("Progress", jobProgress(job)),
              cell("Started", h("time", { datetime: iso(job.created), title: when(job.created) }, ago(job.created))),
            ),
          ),
        ),
      ),
    );
  }
  clearTimeout(state.jobTimer);
  if (state.pending.size || state.jobs.some((job) => job.state === "queued" || job.state === "running")) {
    state.jobTimer = setTimeout(pollJobs, JOB_POLL_MS);
  }
}

async function pollJobs() {
  if (state.owner === null) return;
  try {
    state.jobs = await api("/jobs");
  } catch (err) {
    flash(describe(err), "error");
    return;
  }
  if (settle(state.jobs).length) {
    await refreshQuietly();
  } else {
    renderJobs();
  }
}

// ---------------------------------------------------------------------------- one session
function selectedFromHash() {
  const match = /^#session=(.+)$/.exec(location.hash);
  try {
    return match ? decodeURIComponent(match[1]) : null;
  } catch {
    return null; // a hand-made hash that is not percent-encoded text
  }
}

function row(term, ...value) {
  return h("div", {}, h("dt", {}, term), h("dd", {}, ...value));
}

function overview(session) {
  const g = session.geometry;
  const model = session.model;
  return h(
    "dl",
    { class: "facts" },
    row("Model", `${model.name} @ ${model.revision}`),
    row("Tier", session.tier.description), // "fp8 (v2, e4m3 codes + f32 scale)": the name leads it
    row(
      "Geometry",
      `${g.n_layers} layers × kv_lora ${g.kv_lora} + rope ${g.qk_rope}`,
      g.nic ? `, indexer ${g.nic} × ${g.index_hd}` : "",
      `, vocab ${count(g.vocab)}`,
    ),
    row("Record bytes", `${count(session.record_bytes)} per token`),
    row("Tokens", `${count(session.n_records)} stored, ${count(session.watermark)} resumable (complete turns)`),
    row("Size", bytes(session.size_bytes)),
    row("Created", when(session.created)),
    row("Last use", `${when(session.last_used)} (${ago(session.last_used)})`),
    row("Tags", session.tags.length ? session.tags.join(", ") : h("span", { class: "muted" }, "none")),
    ...["weights_hash", "tokenizer_hash", "chat_template_hash", "attention_variant"]
      .filter((name) => model[name])
      .map((name) => row(name.replace(/_/g, " "), h("code", { class: "wrap" }, model[name]))),
    row("Fingerprint", h("code", { class: "wrap", id: "fingerprint" }, session.fingerprint)),
  );
}

function damageReport(session, inspected, inspectError) {
  const last = state.activity[session.id]?.last_verify;
  const items = [];
  if (session.state === "damaged") {
    items.push(h("li", { class: "bad" }, `Marked damaged: ${session.problem || "no reason recorded"}. Repair it (kvstore repair or POST …/file/repair).`));
  } else if (session.problem) {
    items.push(h("li", {}, `Noted: ${session.problem}`));
  }
  if (last) {
    items.push(
      h(
        "li",
        { class: last.ok ? "good" : "bad" },
        last.ok
          ? `Last verify ${ago(last.time)}: every turn matches its hash${last.turns_checked !== undefined && last.turns_checked !== null ? ` (${plural(last.turns_checked, "turn")})` : ""}.`
          : `Last verify ${ago(last.time)}: the turn from record ${count(last.damaged_from)} does not match its hash; the records before it are intact.`,
      ),
    );
  } else {
    items.push(h("li", { class: "muted" }, "Not verified since the server started."));
  }
  if (inspected) {
    const problems = inspected.problems || [];
    // the journal's size and counts; its file name inside the data folder is the store's business
    if (inspected.file) items.push(h("li", {}, `Journal: ${bytes(inspected.file.bytes)}, ${plural(inspected.turns, "turn")}, ${plural(inspected.loadable_records, "loadable record")}.`));
    items.push(
      problems.length
        ? h("li", { class: "bad" }, "A loader would neutralize: ", h("ul", {}, problems.map((p) => h("li", {}, p))))
        : h("li", { class: "good" }, "The file has no structural problem."),
    );
  } else if (inspectError) {
    items.push(h("li", { class: "bad" }, `Inspect failed: ${inspectError}`));
  } else if (session.state === "parked") {
    items.push(h("li", { class: "muted" }, "Parked: the archive is inspected after unpark."));
  }
  return h("ul", { class: "report" }, items);
}

function reuseHistory(session) {
  const events = [...(state.activity[session.id]?.events || [])].reverse();
  const children = state.sessions.filter((s) => s.parent === session.id);
  const parts = [];
  if (session.parent) {
    parts.push(
      h(
        "p",
        {},
        "Forked from ",
        h("a", { href: `#session=${encodeURIComponent(session.parent)}` }, session.parent),
        ` at record ${count(session.fork_point)}.`,
      ),
    );
  }
  parts.push(
    children.length
      ? h(
          "p",
          {},
          "Forks sharing its prefix: ",
          children.flatMap((c, i) => [i ? ", " : "", h("a", { href: `#session=${encodeURIComponent(c.id)}` }, c.id), ` (${plural(c.fork_point, "record")})`]),
        )
      : h("p", { class: "muted" }, "No forks."),
  );
  if (events.length === 0) {
    parts.push(h("p", { class: "muted" }, "No resume, generate or verify since the server started."));
  } else {
    parts.push(
      h(
        "table",
        { class: "grid events" },
        h("caption", { class: "visually-hidden" }, "Resumes, generates and verifies, newest first"),
        h("thead", {}, h("tr", {}, ...["When", "What", "Reused tokens", "Detail"].map((t) => h("th", { scope: "col" }, t)))),
        h(
          "tbody",
          {},
          events.map((e) =>
            h(
              "tr",
              {},
              cell("When", h("time", { datetime: iso(e.time), title: when(e.time) }, ago(e.time))),
              cell("What", e.kind),
              cell("Reused tokens", e.reused_tokens === null || e.reused_tokens === undefined ? "—" : count(e.reused_tokens)),
              cell("Detail", eventDetail(e)),
            ),
          ),
        ),
      ),
    );
  }
  return parts;
}

function eventDetail(e) {
  if (e.kind === "generate") return `${count(e.prefilled_tokens)} prefilled, rows from ${e.source || "?"}`;
  const parts = [];
  if (e.format) parts.push(e.format === "coli_kv" ? "as a .coli_kv file" : `as ${e.format} rows`);
  if (e.verified) parts.push(e.ok ? "verified: intact" : `verified: bad from record ${count(e.damaged_from)}`);
  return parts.join(", ");
}

async function showSelected({ focus = null } = {}) {
  const id = selectedFromHash();
  const detail = $("detail");
  state.selected = id;
  if (id === null || state.owner === null) {
    detail.hidden = true;
    put(detail);
    return;
  }
  let session;
  try {
    session = await api(`/sessions/${encodeURIComponent(id)}`);
  } catch (err) {
    detail.hidden = false;
    put(detail, h("h2", { id: "detail-title", tabindex: "-1" }, "Session not found"), h("p", { class: "error" }, describe(err)));
    return;
  }
  let inspected = null;
  let inspectError = null;
  if (session.state === "active") {
    try {
      inspected = await api(`/sessions/${encodeURIComponent(id)}/file/inspect`);
    } catch (err) {
      inspectError = describe(err);
    }
  }
  renderDetail(session, inspected, inspectError);
  detail.hidden = false;
  for (const link of document.querySelectorAll(".sessions tr")) link.removeAttribute("aria-current");
  const current = [...document.querySelectorAll(".session-link")].find((a) => a.textContent === id);
  current?.closest("tr").setAttribute("aria-current", "true");
  if (focus) $(focus)?.focus();
}

function renderDetail(session, inspected, inspectError) {
  const id = session.id;
  const parked = session.state === "parked";
  const forkId = h("input", { id: "fork-id", name: "fork-id", autocomplete: "off", spellcheck: "false", placeholder: "generated if empty", maxlength: 64 });
  const actions = h(
    "div",
    { class: "actions", role: "group", "aria-label": `Actions on ${id}` },
    h("button", { type: "button", id: "action-verify", onclick: () => verify(id) }, "Verify"),
    h("button", { type: "button", id: "action-export", onclick: () => exportFile(id), disabled: session.watermark === 0 }, "Export .coli_kv"),
    h("button", { type: "button", id: "action-park", onclick: () => park(id, parked ? "unpark" : "park") }, parked ? "Unpark" : "Park"),
    h("button", { type: "button", id: "action-delete", class: "danger", onclick: () => confirmDelete(id) }, "Delete…"),
  );
  const fork = h(
    "form",
    { class: "fork", onsubmit: (event) => forkSession(event, id) },
    h("label", { for: "fork-id" }, "Fork as new id (optional)"),
    h("div", { class: "inline" }, forkId, h("button", { type: "submit", id: "action-fork" }, "Fork")),
  );
  put(
    $("detail"),
    h(
      "div",
      { class: "section-head" },
      h("h2", { id: "detail-title", tabindex: "-1" }, `Session ${id}`),
      h("a", { href: "#", class: "close", id: "detail-close" }, "Close"),
    ),
    actions,
    fork,
    h("p", { id: "detail-message", role: "status", "aria-live": "polite", class: "message" }),
    h("h3", {}, "Overview"),
    overview(session),
    h("h3", {}, "Damage report"),
    damageReport(session, inspected, inspectError),
    h("h3", {}, "Reuse history"),
    reuseHistory(session),
  );
}

function detailMessage(text, kind = "info") {
  const el = $("detail-message");
  if (!el) return flash(text, kind);
  el.className = `message ${kind}`;
  put(el, text);
}

async function busy(buttonId, label, work) {
  const button = $(buttonId);
  const original = button?.textContent;
  if (button) {
    button.disabled = true;
    button.textContent = label;
  }
  try {
    return await work();
  } finally {
    if (button && button.isConnected) {
      button.disabled = false;
      button.textContent = original;
    }
  }
}

async function verify(id) {
  await busy("action-verify", "Verifying…", async () => {
    let report;
    try {
      report = await api(`/sessions/${encodeURIComponent(id)}/verify`);
    } catch (err) {
      detailMessage(describe(err), "error");
      return;
    }
    await refreshQuietly();
    const text = report.ok
      ? `Verified ${id}: ${plural(report.turns_checked, "turn")}, ${plural(report.n_records, "record")} intact.`
      : `Verify of ${id} found damage: turn ${report.first_bad.turn} (records ${count(report.first_bad.start)}–${count(report.first_bad.end)}) does not match its hash; intact before it: ${plural(report.good_records, "record")}.`;
    detailMessage(text, report.ok ? "good" : "error");
    $("action-verify")?.focus();
  });
}

async function forkSession(event, id) {
  event.preventDefault();
  const wanted = $("fork-id").value.trim();
  await busy("action-fork", "Forking…", async () => {
    let created;
    try {
      created = await api(`/sessions/${encodeURIComponent(id)}/fork`, { method: "POST", body: wanted ? { id: wanted } : {} });
    } catch (err) {
      detailMessage(describe(err), "error");
      $("fork-id")?.focus();
      return;
    }
    flash(`Forked ${id} at record ${count(created.fork_point)} as ${created.id}.`, "good");
    await refreshQuietly(); // the list and the parent's forks now hold it
    location.hash = `session=${encodeURIComponent(created.id)}`;
  });
}

async function exportFile(id) {
  await busy("action-export", "Exporting…", async () => {
    try {
      const response = await api(`/sessions/${encodeURIComponent(id)}/resume?format=coli_kv`, { raw: true });
      const blob = await response.blob();
      const url = URL.createObjectURL(blob);
      const link = h("a", { href: url, download: `${id}.coli_kv`, hidden: true });
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
      detailMessage(`Exported ${id}.coli_kv (${bytes(blob.size)}, ${plural(response.headers.get("X-KV-Records"), "record")}).`, "good");
    } catch (err) {
      detailMessage(describe(err), "error");
    }
  });
}

async function park(id, action) {
  try {
    const job = await api(`/sessions/${encodeURIComponent(id)}/${action}`, { method: "POST" });
    detailMessage(`${action} of ${id} queued (job ${job.id.slice(0, 8)}).`);
    // pending even if it is already done: whichever answer next shows it done (a poll, or a refresh
    // already on its way) refreshes the page for it
    state.pending.set(job.id, Date.now());
    state.jobs = [job, ...state.jobs.filter((j) => j.id !== job.id)];
    renderJobs();
  } catch (err) {
    detailMessage(describe(err), "error");
  }
}

function confirmDelete(id) {
  const dialog = $("confirm-delete");
  put($("confirm-text"), `Delete session ${id} and its files? This cannot be undone.`);
  dialog.dataset.session = id;
  dialog.showModal();
  $("confirm-cancel").focus();
}

function closeDialog(result) {
  const dialog = $("confirm-delete");
  const id = dialog.dataset.session;
  dialog.close();
  delete dialog.dataset.session;
  if (result === "delete" && id) {
    deleteSession(id);
  } else {
    detailMessage(`Kept ${id}.`);
    $("action-delete")?.focus();
  }
}

async function deleteSession(id) {
  try {
    await api(`/sessions/${encodeURIComponent(id)}`, { method: "DELETE" });
  } catch (err) {
    detailMessage(describe(err), "error");
    return;
  }
  flash(`Deleted ${id}.`, "good");
  history.replaceState(null, "", location.pathname);
  await refreshQuietly();
  $("sessions-title").focus();
}

// ---------------------------------------------------------------------------- wiring
function start() {
  $("signin-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", () => signOut("Signed out."));
  $("refresh").addEventListener("click", refreshQuietly);
  $("sessions").addEventListener("click", (event) => {
    if (event.target instanceof Element && event.target.id === "more-sessions") {
      event.target.disabled = true;
      showMoreSessions().catch((err) => flash(describe(err), "error"));
    }
  });
  $("confirm-cancel").addEventListener("click", () => closeDialog("cancel"));
  $("confirm-ok").addEventListener("click", () => closeDialog("delete"));
  $("confirm-delete").addEventListener("cancel", (event) => {
    event.preventDefault(); // Escape: the same as Cancel
    closeDialog("cancel");
  });
  $("detail").addEventListener("click", (event) => {
    if (event.target instanceof Element && event.target.id === "detail-close") {
      event.preventDefault();
      const id = state.selected;
      history.replaceState(null, "", location.pathname);
      showSelected();
      [...document.querySelectorAll(".session-link")].find((a) => a.textContent === id)?.focus();
    }
  });
  window.addEventListener("hashchange", () => {
    if (state.owner !== null) showSelected({ focus: "detail-title" }).catch((err) => flash(describe(err), "error"));
  });
  let width = 0;
  new ResizeObserver((entries) => {
    const now = Math.round(entries[0].contentRect.width);
    if (now !== width && state.store) {
      width = now;
      renderStore();
    }
  }).observe($("store-chart"));
  if (state.key) {
    $("signin").hidden = true; // a key from earlier in this tab: check it before showing the form
    api("/console/me")
      .then((me) => enter(me, false))
      .catch((err) => signOut(err instanceof ApiError && err.status === 401 ? "Sign in again." : describe(err)));
  } else {
    $("signin").hidden = false;
  }
}

start();
