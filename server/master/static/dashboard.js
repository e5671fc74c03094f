// kvstore dashboard: polls the admin API once a second and redraws. No framework, no external assets.
"use strict";

const REFRESH_MS = 1000;
let token = sessionStorage.getItem("kvstore-token") || "";

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

function drawSeries(canvas, series, colors, maxValue) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = "#21262d";
  for (let y = 0; y <= 4; y++) { ctx.beginPath(); ctx.moveTo(0, (h * y) / 4); ctx.lineTo(w, (h * y) / 4); ctx.stroke(); }
  const top = maxValue || Math.max(1, ...series.flat().filter((v) => v !== null));
  series.forEach((values, k) => {
    if (values.length < 2) return;
    ctx.strokeStyle = colors[k];
    ctx.lineWidth = 2;
    ctx.beginPath();
    let drawing = false;  // a null (no lookups that second) leaves a gap
    values.forEach((v, i) => {
      if (v === null) { drawing = false; return; }
      const x = (w * i) / (values.length - 1), y = h - (h * v) / top;
      if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      drawing = true;
    });
    ctx.stroke();
  });
  ctx.fillStyle = "#8b949e";
  ctx.fillText(maxValue ? (100 * top).toFixed(0) + "%" : fmtBytes(top) + "/s", 4, 12);
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
    const [summary, nodes, history] = await Promise.all([
      api("/api/v1/cluster"), api("/api/v1/nodes"), api("/api/v1/history"),
    ]);
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
    status.textContent = summary.nodes_up > 0 ? "healthy" : "no nodes up";
    status.className = "pill " + (summary.nodes_up > 0 ? "ok" : "bad");
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
