// servectl's status page: one event stream (/ui/stream), everything rendered as text.
// Nothing here polls the server: uptimes and countdowns are computed from timestamps.
"use strict";

const $ = (id) => document.getElementById(id);
const page = { hello: null, snapshot: null, source: null, log: null, skew: 0 };

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  if (n >= 2 ** 30) return (n / 2 ** 30).toFixed(2) + " GiB";
  return Math.round(n / 2 ** 20) + " MiB";
}

function duration(s) {
  if (s === null || s === undefined || !isFinite(s)) return "-";
  s = Math.max(0, Math.floor(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h${String(m).padStart(2, "0")}m` : `${m}m${String(sec).padStart(2, "0")}s`;
}

// The server's clock, as the browser sees it now (timestamps in snapshots are the server's).
function serverNow() { return Date.now() / 1000 - page.skew; }

// A cell whose text the browser keeps current from a timestamp: kind "since" (time since t)
// or "until" (t - now).
function timed(kind, t, prefix) {
  const td = el("td", "", "num");
  if (t !== null && t !== undefined) {
    td.dataset.timed = kind;
    td.dataset.t = String(t);
    td.dataset.prefix = prefix || "";
  }
  tick(td);
  return td;
}

function tick(td) {
  const t = Number(td.dataset.t);
  if (!td.dataset.timed) { td.textContent = "-"; return; }
  const s = td.dataset.timed === "since" ? serverNow() - t : t - serverNow();
  td.textContent = td.dataset.prefix + duration(s);
}

function stateCell(state, reason) {
  const td = el("td");
  td.append(el("span", state, "state-" + String(state).replace(/[^a-z]/g, "")));
  if (reason) td.append(el("div", reason, "reason"));
  return td;
}

function renderModels() {
  const body = $("models").tBodies[0];
  const rows = [];
  const snap = page.snapshot;
  const admin = page.hello && page.hello.admin;
  $("actions-head").hidden = !admin;
  for (const m of snap.models) {
    const tr = el("tr");
    tr.dataset.model = m.name;
    tr.append(el("td", m.name), stateCell(m.state, m.reason));
    const reps = el("td");
    for (const g of m.groups) {
      reps.append(el("div", g.name + ": " + g.state + (g.devices ? " on " + g.devices : "") + (g.frozen ? " (frozen)" : "")));
    }
    tr.append(reps);
    tr.append(el("td", bytes(m.groups.reduce((a, g) => a + (g.memory_bytes || 0), 0)) +
      (m.groups.some((g) => g.device_memory_bytes) ? " + " +
        bytes(m.groups.reduce((a, g) => a + (g.device_memory_bytes || 0), 0)) + " device" : ""), "num"));
    const idleSince = m.groups.map((g) => g.idle_since).filter((t) => t !== null);
    const released = m.groups.map((g) => g.released_since).filter((t) => t !== null);
    if (released.length === m.groups.length && released.length) {
      tr.append(timed("since", Math.max(...released), "released "), el("td", "-", "num"));
    } else if (idleSince.length === m.groups.length && idleSince.length) {
      // Idle since the last request on any replica; the first replica goes at its own deadline.
      const after = m.groups[0].release_after_s;
      tr.append(timed("since", Math.max(...idleSince)),
        after > 0 ? timed("until", Math.min(...idleSince) + after) : el("td", "never", "num"));
    } else {
      tr.append(el("td", m.state === "ready" ? "busy" : "-", "num"), el("td", "-", "num"));
    }
    tr.append(el("td", m.running, "num"), el("td", m.waiting, "num"),
      el("td", m.tokens_per_s === null ? "-" : m.tokens_per_s, "num"));
    if (admin) tr.append(actions(m.name, ["unload", "restart", "freeze", "thaw"]));
    rows.push(tr);
  }
  for (const name of snap.unloaded) {
    const tr = el("tr");
    tr.dataset.model = name;
    tr.append(el("td", name), stateCell("unloaded"));
    for (let i = 0; i < 7; i++) tr.append(el("td", "-", "num"));
    if (admin) tr.append(actions(name, ["load"]));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

function actions(model, verbs) {
  const td = el("td");
  for (const verb of verbs) {
    const b = el("button", verb);
    b.type = "button";
    b.dataset.verb = verb;
    b.addEventListener("click", () => act(verb, model, b));
    td.append(b);
  }
  return td;
}

async function act(verb, model, button) {
  button.disabled = true;
  try {
    const r = await fetch("/ui/action", {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": page.hello.csrf },
      body: JSON.stringify({ verb, model }),
    });
    const body = await r.json().catch(() => ({}));
    notice(r.ok ? `${verb} ${model}: ${body.message || "done"}` : `${verb} ${model}: ${(body.error || {}).message || r.status}`, !r.ok);
  } catch (e) {
    notice(`${verb} ${model}: ${e}`, true);
  } finally {
    button.disabled = false;
  }
}

function notice(text, bad) {
  const n = $("notice");
  n.textContent = text;
  n.className = bad ? "notice" : "muted";
  n.hidden = false;
}

function renderProcesses() {
  const rows = page.snapshot.processes.map((p) => {
    const tr = el("tr");
    tr.dataset.component = p.component;
    tr.append(el("td", p.component), el("td", p.kind), el("td", p.pid === null ? "-" : p.pid, "num"),
      stateCell(p.state), timed("since", p.started_at), el("td", p.restarts, "num"), el("td", p.last_exit || "-"),
      el("td", bytes(p.rss_bytes), "num"), el("td", p.cpu_percent === null ? "-" : p.cpu_percent + "%", "num"));
    return tr;
  });
  $("processes").tBodies[0].replaceChildren(...rows);
  const select = $("log-component");
  const have = new Set([...select.options].map((o) => o.value));
  for (const p of page.snapshot.processes) {
    if (!have.has(p.component)) select.append(new Option(p.component, p.component));
  }
}

function renderManager() {
  const m = page.snapshot.manager;
  $("manager").textContent = `manager ${m.pid}, ${m.state}, instance ${m.instance}`;
}

function addEvent(e) {
  const when = new Date(e.time * 1000).toLocaleTimeString();
  const text = `${when} ${e.component} ${e.state}` + (e.pid ? ` pid ${e.pid}` : "") + (e.detail ? `: ${e.detail}` : "");
  const li = el("li", text);
  const list = $("events");
  list.prepend(li);
  while (list.children.length > 200) list.lastElementChild.remove();
}

function addLog(msg) {
  if (msg.component !== page.log) return;
  const pre = $("log-lines");
  if (msg.unknown) { pre.textContent = `${msg.component}: no such process now`; return; }
  const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  for (const line of msg.lines) pre.append(document.createTextNode(line + "\n"));
  const lines = pre.textContent.split("\n");
  if (lines.length > 2000) pre.textContent = lines.slice(-2000).join("\n");
  if (atEnd) pre.scrollTop = pre.scrollHeight;
}

function renderAuth() {
  const h = page.hello;
  $("signin").hidden = !(h.admin_keys && !h.admin);  // an admin key opens logs and buttons
  $("signout").hidden = !h.signed_in;
  $("who").textContent = h.admin ? "admin" : (h.signed_in ? "API key" : "");
  $("logs").hidden = !h.admin;
}

function connect() {
  if (page.source) page.source.close();
  const url = "/ui/stream" + (page.log ? "?log=" + encodeURIComponent(page.log) : "");
  const src = new EventSource(url);
  page.source = src;
  src.addEventListener("hello", (e) => {
    page.hello = JSON.parse(e.data);
    $("events").replaceChildren();  // a (re)connection sends the recent events and the log again
    $("log-lines").textContent = "";
    renderAuth();
    if (page.snapshot) renderModels();
  });
  src.addEventListener("snapshot", (e) => {
    page.snapshot = JSON.parse(e.data);
    page.skew = Date.now() / 1000 - page.snapshot.now;
    renderManager();
    renderModels();
    renderProcesses();
  });
  src.addEventListener("event", (e) => addEvent(JSON.parse(e.data)));
  src.addEventListener("log", (e) => addLog(JSON.parse(e.data)));
  src.addEventListener("open", () => { $("conn").textContent = "live"; });
  src.addEventListener("error", () => {
    $("conn").textContent = "reconnecting…";
    // The browser gives up on a refusal (a restarted daemon, an ended session): load the page
    // again, which signs in anew if it must.
    if (src.readyState === EventSource.CLOSED) setTimeout(() => location.reload(), 3000);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  $("log-component").addEventListener("change", (e) => {
    page.log = e.target.value || null;
    $("log-lines").textContent = "";
    connect();
  });
  // The browser's own clock: uptimes and countdowns move without asking the server.
  setInterval(() => document.querySelectorAll("td[data-timed]").forEach(tick), 1000);
  connect();
});
