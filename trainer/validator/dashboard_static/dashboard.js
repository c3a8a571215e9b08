// prime-node validator dashboard: polls the JSON API of the same origin and renders it (docs/validator.md,
// "Dashboard"). Every value from the API is inserted with textContent or as an attribute value (never
// innerHTML): node versions, hardware names and reasons come from untrusted peers.
"use strict";

const REFRESH_MS = 5000;
const SVG_NS = "http://www.w3.org/2000/svg";
const STATES = ["active", "idle", "stale", "banned"];
let selectedNode = null; // the node whose history is shown
let lastNodes = []; // for the node picker

// ----- small helpers ---------------------------------------------------------------------------------------

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function shortId(id) {
  return id.length > 12 ? id.slice(0, 12) + "…" : id;
}

function iso(ts) {
  return new Date(ts * 1000).toISOString().replace(/\.\d{3}Z$/, "Z");
}

function span(seconds) {
  const s = Math.max(0, seconds);
  if (s < 60) return Math.round(s) + " s";
  if (s < 3600) return Math.round(s / 60) + " min";
  if (s < 86400) return (s / 3600).toFixed(s < 36000 ? 1 : 0) + " h";
  return (s / 86400).toFixed(1) + " d";
}

// "3 min ago" with the exact time (ISO, UTC) as the element's title.
function timeEl(tag, ts, prefix, className) {
  if (ts === null || ts === undefined) return el(tag, "—", className);
  const delta = Date.now() / 1000 - ts;
  const text = delta >= 0 ? span(delta) + " ago" : "in " + span(-delta);
  const node = el(tag, (prefix || "") + text, className);
  node.title = iso(ts);
  return node;
}

function fmt(n, digits) {
  if (n === null || n === undefined) return "—";
  if (Math.abs(n) >= 1e9) return (n / 1e9).toFixed(1) + "G";
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(1) + "k";
  return digits === undefined ? String(n) : n.toFixed(digits);
}

// Hardware as a person reads it: "NVIDIA H100 80 GB · 32 cores · 128 GB RAM"; other keys as "key value".
function hardwareText(hw) {
  hw = hw || {};
  const parts = [];
  if (hw.gpu_model) parts.push(hw.gpu_model + (hw.gpu_memory_mb ? " (" + Math.round(hw.gpu_memory_mb / 1024) + " GB)" : ""));
  else if ("gpu_model" in hw) parts.push("no GPU");
  if (hw.cpu || hw.cpu_cores) parts.push([hw.cpu, hw.cpu_cores ? hw.cpu_cores + " cores" : ""].filter(Boolean).join(", "));
  if (hw.ram_mb) parts.push(Math.round(hw.ram_mb / 1024) + " GB RAM");
  const known = new Set(["gpu_model", "gpu_memory_mb", "cpu", "cpu_cores", "ram_mb"]);
  for (const [k, v] of Object.entries(hw)) {
    if (!known.has(k) && v !== null && v !== "") parts.push(k + " " + v);
  }
  return parts.length ? parts.join(" · ") : "—";
}

// A slash reason shown once: "check: reason" (a reason that already starts with its check, as ledgers written
// before the fix hold, is not prefixed again).
function checkReason(check, reason) {
  if (!check) return reason || "";
  if (!reason) return check;
  return reason.startsWith(check + ":") ? reason : check + ": " + reason;
}

async function getJson(path) {
  const response = await fetch(path, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function cell(tr, label, content, className) {
  const td = el("td", null, className);
  td.dataset.label = label;
  if (content instanceof Node) td.appendChild(content);
  else td.textContent = content === null || content === undefined ? "—" : String(content);
  tr.appendChild(td);
  return td;
}

// ----- health cards ----------------------------------------------------------------------------------------

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function renderHealth(view) {
  const t = view.trainer;
  const badge = document.getElementById("trainer-state");
  badge.textContent = t ? t.state : "unknown";
  badge.className = "badge trainer-" + (t ? t.state : "unknown");
  setText("trainer-step", t && t.step !== null ? "policy step " + t.step : "");
  const detail = document.getElementById("trainer-detail");
  const parts = [];
  if (t && t.step_at) parts.push(timeEl("span", t.step_at, "last step "));
  if (t && t.announced_at) parts.push(el("span", " · "), timeEl("span", t.announced_at, "heard "));
  if (t && t.hint) parts.push(el("span", " — " + t.hint));
  detail.replaceChildren(...parts);

  const totals = view.totals;
  setText("total-nodes", totals.nodes);
  const counts = document.getElementById("state-counts");
  counts.replaceChildren(
    ...STATES.flatMap((s, i) => [
      ...(i ? [el("span", " · ")] : []),
      el("span", totals[s] + " " + s, "state-" + s),
    ]),
  );
  setText("total-accepted", fmt(totals.accepted_files));
  setText("total-rejected", fmt(totals.rejected_files));
  setText("total-tokens", fmt(totals.accepted_tokens));
  setText("total-samples", fmt(totals.accepted_samples));
  const q = view.queue;
  setText("queue-depth", q ? q.depth : "—");
  setText("queue-held", q ? q.held : "—");
  setText("verdict-latency", q && q.verdict_latency_s !== null ? q.verdict_latency_s.toFixed(1) + " s" : "—");
  setText("verdict-rate", q ? q.verdicts_per_min.toFixed(1) + " verdicts/min" : "—");
  for (const w of document.querySelectorAll(".window")) w.textContent = span(view.window_s);
  setText("stale-after", span(view.stale_after_s));
}

// ----- the nodes table -------------------------------------------------------------------------------------

function renderSwarm(view) {
  const table = document.getElementById("swarm");
  document.getElementById("swarm-placeholder").hidden = view.available;
  table.hidden = !view.available;
  setText("policy-step", view.policy_step === null ? "" : "(validator holds policy step " + view.policy_step + ")");
  renderHealth(view);
  const rows = view.nodes.map((n) => {
    const tr = el("tr", null, n.state === "banned" ? "row-banned" : "");
    tr.dataset.nodeId = n.node_id;
    tr.dataset.role = n.role;
    tr.dataset.state = n.state;
    if (n.node_id === selectedNode) tr.classList.add("selected");
    const who = el("span");
    who.append(el("span", shortId(n.node_id), "node-id"), el("span", n.role, "role"));
    who.firstChild.title = n.node_id;
    cell(tr, "node", who);
    const state = el("span");
    state.append(el("span", n.state, "badge state-" + n.state));
    if (n.ban) state.append(el("span", checkReason(n.ban.failed_check, n.ban.slash_reason) || n.ban.reason, "why"));
    cell(tr, "state", state, "state");
    const work = n.role === "contributor" || n.accepted_files > 0;
    const speed = el("span");
    speed.append(el("span", `${fmt(n.tokens_per_s, 1)} tok/s`, "line"), el("span", `${fmt(n.rollouts_per_min, 1)} rollouts/min`, "line"));
    cell(tr, "throughput", work ? speed : "—", "num");
    cell(tr, "files ok / rejected", work ? `${fmt(n.accepted_files)} / ${fmt(n.rejected_files)}` : "—", "num");
    cell(tr, "version", n.version);
    const reach = el("span");
    reach.append(el("span", n.reachability, "reach reach-" + n.reachability), el("span", n.reachability_hint, "hint"));
    cell(tr, "reachability", reach, "reach");
    cell(tr, "hardware", hardwareText(n.hardware), "hw");
    const stale = n.state === "stale" || (n.last_seen !== null && Date.now() / 1000 - n.last_seen > view.stale_after_s);
    cell(tr, "last seen", timeEl("span", n.last_seen, "", stale ? "seen-stale" : ""), "seen");
    tr.addEventListener("click", () => selectNode(n.node_id));
    return tr;
  });
  document.getElementById("swarm-body").replaceChildren(...rows);
  lastNodes = view.nodes;
  renderBans(view.nodes);
  renderPicker();
}

function renderBans(nodes) {
  const banned = nodes.filter((n) => n.ban);
  document.getElementById("bans-empty").hidden = banned.length > 0;
  document.getElementById("bans").replaceChildren(
    ...banned.map((n) => {
      const li = el("li");
      li.dataset.nodeId = n.node_id;
      const head = el("p");
      const id = el("b", shortId(n.node_id), "node-id");
      id.title = n.node_id;
      head.append(id, el("span", " banned "), timeEl("span", n.ban.since));
      head.append(el("span", n.ban.until === null ? ", permanently" : ", "));
      if (n.ban.until !== null) head.append(timeEl("span", n.ban.until, "lifted "));
      li.append(head);
      const why = checkReason(n.ban.failed_check, n.ban.slash_reason);
      if (why) li.append(el("p", "slashed for " + why, "slash-reason"));
      li.append(el("p", "ban: " + n.ban.reason + " · " + n.slashes + " slash(es)", "muted"));
      return li;
    }),
  );
}

// ----- leaderboard -----------------------------------------------------------------------------------------

function renderLeaderboard(data) {
  const rows = data.nodes.map((n) => {
    const tr = el("tr", null, n.banned ? "row-banned" : "");
    tr.dataset.nodeId = n.node_id;
    cell(tr, "#", n.rank, "num");
    const id = el("span", shortId(n.node_id), "node-id");
    id.title = n.node_id;
    cell(tr, "node", id);
    cell(tr, "accepted tokens", fmt(n.accepted_tokens), "num");
    cell(tr, "rollouts", fmt(n.accepted_samples), "num");
    cell(tr, "files ok", fmt(n.accepted_files), "num");
    cell(tr, "rejected", fmt(n.rejected_files), "num");
    cell(tr, "score", n.score.toFixed(1), "num");
    cell(tr, "slashes", n.slashes, "num");
    tr.addEventListener("click", () => selectNode(n.node_id));
    return tr;
  });
  document.getElementById("leaderboard-body").replaceChildren(...rows);
  document.getElementById("leaderboard-empty").hidden = rows.length > 0;
}

// ----- charts ----------------------------------------------------------------------------------------------

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = String(text);
  return node;
}

// A chart is drawn in the pixels it is shown at (its container's width), so that its text keeps its size on a
// phone instead of shrinking with the picture.
function chartSize(svg, height) {
  const w = Math.round(Math.max(300, Math.min(900, svg.parentElement.clientWidth || 640)));
  svg.setAttribute("viewBox", `0 0 ${w} ${height}`);
  return w;
}

// Round tick values covering [lo, hi], about `count` of them.
function ticks(lo, hi, count) {
  if (hi <= lo) return [lo];
  const raw = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toFixed(10));
  return out;
}

// Axes with ticks and labels in a w x h chart; returns the scales and the SVG parts.
function frame(w, h, box, xs, ys, labels) {
  const [left, right, top, bottom] = box;
  const x = (v) => left + ((v - xs[0]) / Math.max(1e-9, xs[1] - xs[0])) * (w - left - right);
  const y = (v) => h - bottom - ((v - ys[0]) / Math.max(1e-9, ys[1] - ys[0])) * (h - top - bottom);
  const parts = [svgEl("text", { x: left, y: 16, class: "title" }, labels.title)];
  for (const v of ticks(ys[0], ys[1], 4)) {
    parts.push(svgEl("line", { x1: left, x2: w - right, y1: y(v), y2: y(v), class: "grid" }));
    parts.push(svgEl("text", { x: left - 6, y: y(v) + 4, class: "tick ytick", "text-anchor": "end" }, labels.yfmt(v)));
  }
  for (const v of ticks(xs[0], xs[1], Math.max(3, Math.floor((w - left - right) / 70))).filter((t) => Number.isInteger(t))) {
    parts.push(svgEl("line", { x1: x(v), x2: x(v), y1: h - bottom, y2: h - bottom + 4, class: "axis" }));
    parts.push(svgEl("text", { x: x(v), y: h - bottom + 16, class: "tick xtick", "text-anchor": "middle" }, v));
  }
  parts.push(
    svgEl("line", { x1: left, y1: h - bottom, x2: w - right, y2: h - bottom, class: "axis x-axis" }),
    svgEl("line", { x1: left, y1: top, x2: left, y2: h - bottom, class: "axis y-axis" }),
    svgEl("text", { x: (left + w - right) / 2, y: h - 6, class: "label xlabel", "text-anchor": "middle" }, labels.x),
    svgEl("text", { x: 12, y: (top + h - bottom) / 2, class: "label ylabel", "text-anchor": "middle",
      transform: `rotate(-90 12 ${(top + h - bottom) / 2})` }, labels.y),
  );
  return { x, y, parts };
}

function legend(items, x0, y) {
  const parts = [];
  let x = x0; // one row under the title, from the plot's left edge
  for (const [cls, text, kind] of items) {
    const mark = kind === "bar"
      ? svgEl("rect", { x, y: y - 9, width: 12, height: 10, class: cls })
      : svgEl("line", { x1: x, x2: x + 18, y1: y - 4, y2: y - 4, class: cls });
    parts.push(mark, svgEl("text", { x: x + 22, y, class: "tick legend-item" }, text));
    x += 30 + text.length * 6.2;
  }
  return parts;
}

// The curve is the validator's own: the mean task reward per policy step of the files it accepted, from the
// rewards it recomputed (GET /api/rewards). Steps without a point are gaps: the line breaks there (a dashed
// line marks the span). One circle per step carries its numbers for tooltips and tests.
let lastCurve = null;
let lastHistory = null;

function renderRewards(curve) {
  lastCurve = curve;
  const svg = document.getElementById("reward-chart");
  const ready = curve.available && curve.points.length > 0;
  document.getElementById("rewards-placeholder").hidden = ready;
  document.getElementById("reward-box").hidden = !ready; // `hidden` is an HTML attribute: SVG ignores it
  if (!ready) return;
  const pts = curve.points;
  const lo = pts[0].step, hi = pts[pts.length - 1].step;
  const xs = lo === hi ? [lo - 0.5, hi + 0.5] : [lo, hi];
  const { x, y, parts } = frame(chartSize(svg, 260), 260, [52, 16, 48, 42], xs, [0, 1], {
    title: "Mean task reward of accepted rollouts", x: "policy step", y: "task reward", yfmt: (v) => v.toFixed(2),
  });
  let run = [];
  const flush = () => {
    if (run.length > 1) parts.push(svgEl("polyline", { points: run.join(" "), class: "series" }));
    run = [];
  };
  pts.forEach((p, i) => {
    if (i > 0 && p.step - pts[i - 1].step > 1) {
      flush();
      const a = pts[i - 1];
      parts.push(svgEl("line", { x1: x(a.step), y1: y(a.reward), x2: x(p.step), y2: y(p.reward), class: "gap" }));
    }
    run.push(`${x(p.step)},${y(Math.min(1, Math.max(0, p.reward)))}`);
  });
  flush();
  for (const p of pts) {
    const dot = svgEl("circle", { cx: x(p.step), cy: y(Math.min(1, Math.max(0, p.reward))), r: 3,
      "data-step": p.step, "data-reward": p.reward });
    dot.appendChild(svgEl("title", {}, `step ${p.step}: mean task reward ${p.reward.toFixed(3)} over ${p.samples} rollouts`));
    parts.push(dot);
  }
  parts.push(...legend([["series", "mean task reward", "line"], ["gap", "steps without accepted rollouts", "line"]], 52, 36));
  const last = pts[pts.length - 1];
  setText("reward-latest", `latest: step ${last.step}, mean task reward ${last.reward.toFixed(3)} (${last.samples} rollouts)`);
  svg.replaceChildren(...parts);
}

function renderHistory(history) {
  lastHistory = history;
  const pts = history.points;
  const svg = document.getElementById("history-chart");
  if (!pts.length) {
    svg.replaceChildren(svgEl("text", { x: 20, y: 40, class: "label" }, "no verdicts yet"));
    return;
  }
  const lo = pts[0].step, hi = pts[pts.length - 1].step;
  const top = Math.max(1, ...pts.map((p) => p.accepted + p.rejected));
  const { x, y, parts } = frame(chartSize(svg, 220), 220, [52, 16, 48, 42], [lo - 0.5, hi + 0.5], [0, top], {
    title: "Files per policy step", x: "policy step", y: "files", yfmt: (v) => (Number.isInteger(v) ? v : ""),
  });
  const width = Math.max(2, Math.min(24, (x(lo + 1) - x(lo)) * 0.7));
  for (const p of pts) {
    const base = y(0);
    const ok = svgEl("rect", { x: x(p.step) - width / 2, y: y(p.accepted), width, height: base - y(p.accepted),
      class: "bar-ok", "data-step": p.step, "data-accepted": p.accepted });
    ok.appendChild(svgEl("title", {}, `step ${p.step}: ${p.accepted} accepted, ${p.rejected} rejected`));
    const bad = svgEl("rect", { x: x(p.step) - width / 2, y: y(p.accepted + p.rejected), width,
      height: y(p.accepted) - y(p.accepted + p.rejected), class: "bar-bad", "data-step": p.step,
      "data-rejected": p.rejected });
    parts.push(ok, bad);
  }
  parts.push(...legend([["bar-ok", "accepted", "bar"], ["bar-bad", "rejected", "bar"]], 52, 36));
  svg.replaceChildren(...parts);
}

// ----- one node ---------------------------------------------------------------------------------------------

function renderPicker() {
  const select = document.getElementById("node-select");
  const seen = new Set();
  const options = [el("option", "choose a node (or click a row)")];
  options[0].value = "";
  for (const n of lastNodes) {
    if (seen.has(n.node_id)) continue;
    seen.add(n.node_id);
    const o = el("option", `${shortId(n.node_id)} (${n.role}, ${n.state})`);
    o.value = n.node_id;
    options.push(o);
  }
  select.replaceChildren(...options);
  select.value = selectedNode && seen.has(selectedNode) ? selectedNode : "";
}

async function selectNode(nodeId) {
  selectedNode = nodeId;
  for (const tr of document.querySelectorAll("tr[data-node-id]")) tr.classList.toggle("selected", tr.dataset.nodeId === nodeId);
  document.getElementById("node-select").value = nodeId;
  await showNode(nodeId);
}

async function showNode(nodeId) {
  const box = document.getElementById("node-detail");
  const summary = document.getElementById("node-summary");
  box.hidden = false;
  let detail;
  try {
    detail = await getJson("/api/node/" + encodeURIComponent(nodeId));
  } catch (err) {
    // Trainer, validator and relays have no ledger entry: nothing to chart.
    summary.replaceChildren(el("b", nodeId, "node-id"), el("span", " — no verdicts: " + err.message));
    document.getElementById("history-chart").replaceChildren();
    document.getElementById("node-verdicts").replaceChildren();
    return;
  }
  const n = detail.node;
  summary.replaceChildren(
    el("b", n.node_id, "node-id"),
    el("span", ` — rank ${n.rank} of ${detail.ranked}, score ${n.score.toFixed(1)}, ${n.accepted_files} accepted, ` +
      `${n.rejected_files} rejected, ${n.slashes} slash(es)`),
  );
  document.getElementById("node-verdicts").replaceChildren(
    ...detail.recent.map((c) => {
      const li = el("li");
      li.append(timeEl("span", c.decided_at), el("span",
        `: step ${c.step}, ` + (c.accepted ? `accepted ${c.samples} rollouts, ${c.tokens} tokens` : "rejected — " + checkReason(c.failed_check, c.reason))));
      return li;
    }),
  );
  try {
    renderHistory(await getJson("/api/node/" + encodeURIComponent(n.node_id) + "/history"));
  } catch (err) {
    document.getElementById("history-chart").replaceChildren(svgEl("text", { x: 20, y: 40 }, "could not load: " + err.message));
  }
}

// ----- polling ----------------------------------------------------------------------------------------------

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [board, swarm, rewards] = await Promise.all([
      getJson("/api/leaderboard?top=100"), getJson("/api/swarm"), getJson("/api/rewards"),
    ]);
    renderLeaderboard(board);
    renderSwarm(swarm);
    renderRewards(rewards);
    if (selectedNode) await showNode(selectedNode);
    status.textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "1"; // lets tests and scripts wait for the first render
  } catch (err) {
    status.textContent = "cannot reach the validator: " + err.message;
  }
}

document.getElementById("node-select").addEventListener("change", (e) => {
  if (e.target.value) selectNode(e.target.value);
});
window.addEventListener("resize", () => {
  if (lastCurve) renderRewards(lastCurve);
  if (lastHistory && selectedNode) renderHistory(lastHistory);
});
refresh();
setInterval(refresh, REFRESH_MS);
