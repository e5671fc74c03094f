// kvstore dashboard: polls the admin API once a second and redraws. No framework, no external assets.
"use strict";

const REFRESH_MS = 1000;
let token = sessionStorage.getItem("kvstore-token") || "";
// A link may carry the token in its fragment (#token=...), which the browser never sends to a server:
// kept for this tab, and taken off the address at once.
const linked = new URLSearchParams(location.hash.slice(1)).get("token");
if (linked) {
  token = linked;
  sessionStorage.setItem("kvstore-token", token);
  history.replaceState(null, "", location.pathname + location.search);
}

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

async function api(path) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const resp = await fetch(path, { headers });
  if (resp.status === 401) {
    document.getElementById("token-box").hidden = false;
    throw new Error("this cluster needs an admin token");
  }
  if (!resp.ok) throw new Error(path + ": HTTP " + resp.status);
  return resp.json();
}

function bar(kind, used, capacity) {
  const pct = capacity > 0 ? Math.min(100, (100 * used) / capacity) : 0;
  return `<span class="bar ${kind}"><span style="width:${pct.toFixed(1)}%"></span></span>` +
    `<span class="bar-text">${fmtBytes(used)} / ${fmtBytes(capacity)}</span>`;
}

function fmtTick(v, percent) {
  return percent ? (100 * v).toFixed(0) + "%" : fmtBytes(v) + "/s";
}

// A line chart on a canvas sized for the screen's pixel ratio: a y axis with labelled ticks, the last
// five minutes along x. maxValue: a fixed top (1 for a ratio, drawn as a percentage).
function drawSeries(canvas, series, colors, maxValue) {
  const ratio = window.devicePixelRatio || 1;
  const cssW = Number(canvas.getAttribute("width")), cssH = Number(canvas.getAttribute("height"));
  if (canvas.dataset.ratio !== String(ratio)) {
    canvas.style.width = cssW + "px"; canvas.style.height = cssH + "px";
    canvas.width = cssW * ratio; canvas.height = cssH * ratio; canvas.dataset.ratio = String(ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, cssW, cssH);
  const left = 84, right = 12, top = 8, bottom = 22;
  const w = cssW - left - right, h = cssH - top - bottom;
  const percent = maxValue === 1;
  const most = maxValue || Math.max(1, ...series.flat().filter((v) => v !== null));
  ctx.font = "12px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  for (let k = 0; k <= 4; k++) {
    const y = top + h - (h * k) / 4;
    ctx.strokeStyle = "#21262d"; ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + w, y); ctx.stroke();
    ctx.fillStyle = "#c9d1d9"; ctx.textAlign = "right";
    ctx.fillText(fmtTick((most * k) / 4, percent), left - 6, y);
  }
  ctx.textBaseline = "alphabetic"; ctx.fillStyle = "#c9d1d9";
  [["-5 min", 0, "left"], ["-2.5 min", 0.5, "center"], ["now", 1, "right"]].forEach(([label, f, align]) => {
    ctx.textAlign = align;
    ctx.fillText(label, left + w * f, cssH - 6);
  });
  series.forEach((values, k) => {
    if (values.length < 2) return;
    ctx.strokeStyle = colors[k];
    ctx.lineWidth = 2;
    ctx.beginPath();
    let drawing = false;  // a null (no lookups that second) leaves a gap
    values.forEach((v, i) => {
      if (v === null) { drawing = false; return; }
      const x = left + (w * (300 - values.length + 1 + i)) / 300, y = top + h - (h * Math.min(v, most)) / most;
      if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      drawing = true;
    });
    ctx.stroke();
  });
}

function esc(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

function renderMasters(m, leadership) {
  document.getElementById("leader").textContent = m.leader || "none (an election)";
  document.getElementById("epoch").textContent = m.epoch || (leadership.ha ? "–" : "no HA");
  document.getElementById("role").textContent = leadership.role;
  const rows = m.masters.map((x) => {
    const behind = x.follows === null ? "–" : x.follows ? "follows the leader" :
      `behind: last saw epoch ${x.leader_epoch_seen ?? "none"} (the leader's is ${m.epoch})`;
    const lease = x.lease_confirmed_s_ago === null ? "–" : `${x.lease_confirmed_s_ago.toFixed(1)} s ago`;
    const etcd = x.etcd_reachable === null ? "–" : x.etcd_reachable ? "reachable" : "unreachable";
    const role = x.role === "unreachable" || x.role === "unknown" ? `<td class="down">${esc(x.role)}</td>` :
      `<td class="${x.role === "leader" ? "up" : ""}">${esc(x.role)}</td>`;
    return `<tr data-master="${esc(x.address)}"><td>${esc(x.address)}</td>${role}<td>${behind}</td><td>${lease}</td>` +
      `<td class="${x.etcd_reachable === false ? "down" : ""}">${etcd}</td><td>${esc(x.admin || "–")}` +
      `${x.error ? ` <span class="muted">(${esc(x.error)})</span>` : ""}</td></tr>`;
  });
  document.querySelector("#masters tbody").innerHTML = rows.join("");
}

function renderTenants(list) {
  const rows = list.tenants.map((t) => {
    const held = t.quota_bytes > 0 ? bar(t.held_bytes > 0.9 * t.quota_bytes ? "full" : "dram", t.held_bytes, t.quota_bytes)
      : `<span class="bar-text">${fmtBytes(t.held_bytes)} (no quota)</span>`;
    return `<tr data-tenant="${esc(t.tenant)}"><td>${esc(t.tenant)}</td><td>${held}</td><td>${t.sessions}</td>` +
      `<td>${t.requests_per_s.toFixed(1)}</td></tr>`;
  });
  document.querySelector("#tenants tbody").innerHTML = rows.join("") ||
    `<tr><td colspan="4" class="muted">no tenants file: every client is the cluster's</td></tr>`;
}

function renderAlerts(a) {
  document.getElementById("alert-count").textContent = a.alerts.length;
  document.getElementById("alert-count").className = "value " + (a.alerts.length ? "down" : "up");
  document.getElementById("alert-source").textContent = a.source === "prometheus" ? "(from Prometheus)" :
    `(this master's own view${a.error ? "; " + a.error : ""})`;
  const items = a.alerts.map((x) => {
    const labels = Object.entries(x.labels).map(([k, v]) => `${esc(k)}=${esc(v)}`).join(" ");
    const since = x.since_s === null || x.since_s === undefined ? "" : ` <span class="muted">for ${x.since_s.toFixed(0)} s</span>`;
    return `<li class="${x.severity === "page" ? "page" : "warning"}" data-alert="${esc(x.name)}">` +
      `<b>${esc(x.name)}</b> <span class="muted">${esc(x.severity)} ${labels}</span>${since}<br>${esc(x.summary)}</li>`;
  });
  document.getElementById("alerts").innerHTML = items.join("") || `<li class="none">none firing</li>`;
}

function renderNodes(nodes) {
  const rows = nodes.map((n) => {
    const d = n.tiers.dram, s = n.tiers.ssd;
    const state = n.draining ? "draining" : n.up ? "up" : "down";
    return `<tr data-node="${n.node_id}"><td>${n.node_id}</td><td class="${n.up ? "up" : "down"}">${state}</td>` +
      `<td>${n.address}</td><td>${bar("dram", d.used, d.capacity)}</td><td>${bar("ssd", s.used, s.capacity)}</td>` +
      `<td>${d.blocks + s.blocks}</td><td>${(n.last_heartbeat_ms_ago / 1000).toFixed(1)} s ago</td></tr>`;
  });
  document.querySelector("#nodes tbody").innerHTML = rows.join("");
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [summary, nodes, history, leadership, masters, tenants, alerts] = await Promise.all([
      api("/api/v1/cluster"), api("/api/v1/nodes"), api("/api/v1/history"), api("/api/v1/leadership"),
      api("/api/v1/masters"), api("/api/v1/tenants"), api("/api/v1/alerts"),
    ]);
    renderMasters(masters, leadership);
    renderTenants(tenants);
    renderAlerts(alerts);
    document.getElementById("nodes-up").textContent = `${summary.nodes_up} / ${summary.nodes}`;
    document.getElementById("objects").textContent = summary.objects.toLocaleString();
    document.getElementById("hit-rate").textContent = (100 * summary.hit_rate).toFixed(1) + "%";
    document.getElementById("gets").textContent = summary.rates.gets_per_s.toFixed(0);
    document.getElementById("read").textContent = fmtBytes(summary.rates.read_bytes_per_s) + "/s";
    document.getElementById("written").textContent = fmtBytes(summary.rates.written_bytes_per_s) + "/s";
    renderNodes(nodes.nodes);
    const pts = history.points;
    drawSeries(document.getElementById("chart-hits"), [pts.map((p) => p.hit_rate)], ["#3fb950"], 1);
    drawSeries(document.getElementById("chart-bytes"),
      [pts.map((p) => p.read_bytes_per_s), pts.map((p) => p.written_bytes_per_s)], ["#58a6ff", "#d29922"]);
    const down = summary.nodes - summary.nodes_up;
    status.textContent = summary.nodes_up === 0 ? "no nodes up" : down > 0 ? `${down} node${down > 1 ? "s" : ""} down` :
      alerts.alerts.length ? "alerts firing" : "healthy";
    status.className = "pill " + (summary.nodes_up > 0 && down === 0 && !alerts.alerts.length ? "ok" : "bad");
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "true";
  } catch (err) {
    status.textContent = String(err.message || err);
    status.className = "pill bad";
  }
}

document.getElementById("token-save").addEventListener("click", () => {
  token = document.getElementById("token").value;
  sessionStorage.setItem("kvstore-token", token);
  document.getElementById("token-box").hidden = true;
  refresh();
});

refresh();
setInterval(refresh, REFRESH_MS);
