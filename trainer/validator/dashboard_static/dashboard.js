// prime-node validator dashboard: polls the JSON API of the same origin and renders it.
// Every value from the API is inserted with textContent (never innerHTML): node ids, reasons and
// hardware strings come from untrusted peers.
"use strict";

const REFRESH_MS = 5000;
const SVG_NS = "http://www.w3.org/2000/svg";

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function shortId(id) {
  return id.length > 12 ? id.slice(0, 12) + "…" : id;
}

function ago(ts) {
  if (ts === null || ts === undefined) return "—";
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return Math.round(s) + " s ago";
  if (s < 3600) return Math.round(s / 60) + " min ago";
  if (s < 86400) return Math.round(s / 3600) + " h ago";
  return Math.round(s / 86400) + " d ago";
}

function banText(row) {
  if (!row.banned) return "—";
  if (row.ban_permanent) return "permanent";
  return "until " + new Date(row.banned_until * 1000).toISOString().replace(".000Z", "Z");
}

function hardwareText(hw) {
  return Object.entries(hw || {}).map(([k, v]) => k + "=" + v).join(", ");
}

async function getJson(path) {
  const response = await fetch(path, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function renderLeaderboard(data) {
  const body = document.getElementById("leaderboard-body");
  const rows = data.nodes.map((n) => {
    const tr = el("tr", null, n.banned ? "banned" : "");
    tr.dataset.nodeId = n.node_id;
    const cells = [
      [n.rank, "num"], [shortId(n.node_id), "node"], [n.accepted_tokens, "num"], [n.accepted_samples, "num"],
      [n.accepted_files, "num"], [n.rejected_files, "num"], [n.score.toFixed(1), "num"], [n.slashes, "num"],
      [banText(n), "ban"], [ago(n.last_seen), "seen"], [hardwareText(n.hardware), "hw"],
    ];
    for (const [text, cls] of cells) tr.appendChild(el("td", text, cls));
    tr.cells[1].title = n.node_id;
    tr.addEventListener("click", () => showNode(n.node_id));
    return tr;
  });
  body.replaceChildren(...rows);
  document.getElementById("leaderboard-empty").hidden = rows.length > 0;
}

async function showNode(nodeId) {
  const box = document.getElementById("node-detail");
  try {
    const d = await getJson("/api/node/" + encodeURIComponent(nodeId));
    const items = [
      el("h3", "node " + d.node.node_id),
      el("p", `rank ${d.node.rank}, score ${d.node.score.toFixed(1)}, ban: ${banText(d.node)}`),
    ];
    const list = el("ul");
    for (const c of d.recent) {
      const verdict = c.accepted ? "accepted" : `rejected (${c.failed_check}: ${c.reason})`;
      list.appendChild(el("li", `step ${c.step}: ${c.samples} samples, ${c.tokens} tokens, ${verdict}`));
    }
    items.push(list);
    box.replaceChildren(...items);
  } catch (err) {
    box.replaceChildren(el("p", "could not load node: " + err.message));
  }
  box.hidden = false;
}

function renderSwarm(view) {
  const table = document.getElementById("swarm");
  document.getElementById("swarm-placeholder").hidden = view.available;
  table.hidden = !view.available;
  document.getElementById("policy-step").textContent =
    view.policy_step === null || view.policy_step === undefined ? "" : "(policy step " + view.policy_step + ")";
  const rows = view.nodes.map((n) => {
    const tr = el("tr");
    for (const text of [shortId(n.node_id), n.roles.join(", "), n.step ?? "—", hardwareText(n.hardware), ago(n.last_seen)]) {
      tr.appendChild(el("td", text));
    }
    return tr;
  });
  document.getElementById("swarm-body").replaceChildren(...rows);
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = String(text);
  return node;
}

// The curve is the validator's own: the mean task reward per policy step of the files it accepted, from the
// rewards it recomputed (GET /api/rewards). One circle per step carries its numbers for tooltips and tests.
function renderRewards(curve) {
  const svg = document.getElementById("reward-chart");
  const ready = curve.available && curve.points.length > 0;
  document.getElementById("rewards-placeholder").hidden = ready;
  document.getElementById("reward-box").hidden = !ready; // `hidden` is an HTML attribute: SVG ignores it
  if (!ready) return;
  const [w, h, pad] = [600, 200, 28];
  const steps = curve.points.map((p) => p.step);
  const lo = Math.min(...steps), hi = Math.max(...steps);
  const x = (s) => pad + ((s - lo) / Math.max(1, hi - lo)) * (w - 2 * pad);
  const y = (r) => h - pad - Math.min(1, Math.max(0, r)) * (h - 2 * pad); // task reward is in [0, 1]
  const parts = [
    svgEl("line", { x1: pad, y1: h - pad, x2: w - pad, y2: h - pad, class: "axis" }),
    svgEl("line", { x1: pad, y1: pad, x2: pad, y2: h - pad, class: "axis" }),
    svgEl("text", { x: 2, y: y(1) + 4, class: "tick" }, "1"),
    svgEl("text", { x: 2, y: y(0) + 4, class: "tick" }, "0"),
    svgEl("text", { x: pad, y: h - 6, class: "tick" }, "step " + lo),
    svgEl("text", { x: w - pad, y: h - 6, class: "tick", "text-anchor": "end" }, "step " + hi),
    svgEl("polyline", { points: curve.points.map((p) => `${x(p.step)},${y(p.reward)}`).join(" ") }),
  ];
  for (const p of curve.points) {
    const dot = svgEl("circle", { cx: x(p.step), cy: y(p.reward), r: 3, "data-step": p.step, "data-reward": p.reward });
    dot.appendChild(svgEl("title", {}, `step ${p.step}: mean task reward ${p.reward.toFixed(3)} over ${p.samples} samples`));
    parts.push(dot);
  }
  const last = curve.points[curve.points.length - 1];
  document.getElementById("reward-latest").textContent =
    `latest: step ${last.step}, mean task reward ${last.reward.toFixed(3)} (${last.samples} samples)`;
  svg.replaceChildren(...parts);
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [board, swarm, rewards] = await Promise.all([
      getJson("/api/leaderboard?top=100"), getJson("/api/swarm"), getJson("/api/rewards"),
    ]);
    renderLeaderboard(board);
    renderSwarm(swarm);
    renderRewards(rewards);
    status.textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "1"; // lets tests and scripts wait for the first render
  } catch (err) {
    status.textContent = "cannot reach the validator: " + err.message;
  }
}

refresh();
setInterval(refresh, REFRESH_MS);
