// The status page: reads api/v1/status every REFRESH_MS and redraws. No inline code, no
// external assets: it runs under the page's Content-Security-Policy, offline.
"use strict";

const REFRESH_MS = 2000;
let lastOk = null;
// where a busy ratio turns from bad to middling to good: the document's (the thresholds'
// gpu_busy_low and gpu_busy_target), so the page colours as the alerts judge
let bands = { low: 0.5, target: 0.9 };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v; else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

// A ratio in percent: one decimal, two significant digits under 0.1 % (a CPU run's MFU
// against an H100 is 0.011 %, not 0.0 %), as exporter.heuristics.verdict.percent writes it
function pct(x) {
  if (x === null || x === undefined) return "n/a";
  const v = x * 100;
  return (v !== 0 && Math.abs(v) < 0.1 ? v.toPrecision(2) : v.toFixed(1)) + "%";
}
const num = (x, digits) => (x === null || x === undefined ? "n/a" : x.toFixed(digits));
function bytes(x) {
  if (x === null || x === undefined) return "n/a";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(x) >= 1024 && i < units.length - 1) { x /= 1024; i++; }
  return x.toFixed(i ? 1 : 0) + " " + units[i];
}
const rate = (x) => (x === null || x === undefined ? "n/a" : bytes(x) + "/s");
function ago(s) {
  if (s === null || s === undefined) return "n/a";
  if (s < 90) return Math.round(s) + " s";
  if (s < 5400) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}

// A bar of a 0-1 ratio; "good" says which end is healthy ("high", "low" or "none").
function bar(ratio, label, good, wide) {
  const fill = el("div", { class: "fill" });
  const r = ratio === null || ratio === undefined ? 0 : Math.max(0, Math.min(1, ratio));
  fill.style.width = (r * 100).toFixed(1) + "%";
  if (good === "high") fill.classList.add(r >= bands.target ? "ok" : r >= bands.low ? "mid" : "low");
  else fill.classList.add("plain");
  return el("div", { class: wide ? "bar wide" : "bar", title: label }, fill, el("span", {}, label));
}

// Who uses a GPU: its ranks, each with its share of the GPU's time where the driver gives
// per-process samples, then the share no rank owns ("others")
function users(g) {
  const shares = Object.fromEntries((g.shares || []).filter((x) => x.run !== null)
    .map((x) => [x.run + "/" + x.rank, x.busy]));
  const parts = g.ranks.map((r) => {
    const key = r.run + "/" + r.rank;
    return key + (key in shares ? " " + pct(shares[key]) : "");
  });
  const others = (g.shares || []).find((x) => x.run === null);
  if (others && others.busy > 0) parts.push("others " + pct(others.busy));
  return parts;
}

function gpuRow(g) {
  const name = (g.name || "").replace(/^NVIDIA /, "");
  const parts = users(g);
  const who = el("td", { class: "who" }, ...(parts.length ? parts.map((p, i) =>
    (i ? ", " : "") + p) : [el("span", { class: "muted" }, "no run pushes here")]));
  if (!g.up) {
    return el("tr", { class: "lost", "data-gpu": g.gpu },
      el("td", {}, el("b", {}, g.gpu), " ", name),
      el("td", { colspan: 7 }, "lost: the GPU does not answer NVML (see the log)"), who);
  }
  const memRatio = g.memory_total_bytes ? g.memory_used_bytes / g.memory_total_bytes : null;
  const powRatio = g.power_limit_watts ? g.power_watts / g.power_limit_watts : null;
  return el("tr", { "data-gpu": g.gpu },
    el("td", { title: g.uuid }, el("b", {}, g.gpu), " ", name),
    el("td", {}, bar(g.busy, pct(g.busy), "high")),
    el("td", {}, bar(g.sm_active, pct(g.sm_active), "high")),
    el("td", {}, bar(g.tensor_active, pct(g.tensor_active), "none")),
    el("td", {}, bar(memRatio, bytes(g.memory_used_bytes) + " / " + bytes(g.memory_total_bytes),
                     "none", true)),
    el("td", {}, bar(powRatio, num(g.power_watts, 0) + " / " + num(g.power_limit_watts, 0) + " W",
                     "none")),
    el("td", {}, rate(g.pcie_rx_bytes_per_second) + " / " + rate(g.pcie_tx_bytes_per_second)),
    el("td", {}, g.temperature_celsius === null ? "n/a" : Math.round(g.temperature_celsius) + " °C"),
    who);
}

// A rank's GPUs by name, "GPU 0 (H100 80GB HBM3)": an index alone reads as a count
function gpuNames(gpus, byUuid) {
  if (!gpus.length) return "none known";
  const models = [...new Set(gpus.map((g) => ((byUuid[g.uuid] || {}).name || "")
    .replace(/^NVIDIA /, "")).filter(Boolean))];
  return (gpus.length === 1 ? "GPU " : "GPUs ") + gpus.map((g) => g.gpu).join(", ")
    + (models.length ? " (" + models.join(", ") + ")" : "");
}

// When a rank last pushed: a finished rank said goodbye (never red), a silent one did not
function lastPush(r) {
  const when = ago(r.seconds_since_push) + " ago";
  if (r.failed) return el("td", { class: "stale" }, "failed " + when
    + (r.exit_detail ? " (" + r.exit_detail + ")" : ""));
  if (r.finished) return el("td", { class: "muted" }, "finished " + when);
  if (r.pushing) return el("td", {}, when);
  return el("td", { class: "stale" }, "stopped pushing " + when);
}

// The step in progress: how long since the rank's last step ended, and what holds it (a
// declared phase, or where a hang's stacks found it)
function lastStep(r) {
  if (r.finished || r.failed) return el("td", { class: "muted" }, "—");
  const phase = Object.entries(r.phase_in_progress || {})[0];
  if (phase) return el("td", {}, "in " + phase[0] + " " + ago(phase[1]));
  if (r.step_in_progress_seconds === null || r.step_in_progress_seconds === undefined) {
    return el("td", {}, r.seconds_since_step === null ? "n/a" : ago(r.seconds_since_step) + " ago");
  }
  const where = r.location ? " · " + r.location + " in " + r.location_function : "";
  return el("td", { class: r.verdict === "hung" ? "stale" : "", "data-open-step": r.rank },
    "step open " + ago(r.step_in_progress_seconds) + where);
}

function runCard(run, byUuid) {
  const top = run.verdicts[0];
  const card = el("div", { class: "card " + top.status, "data-run": run.run },
    el("h3", {}, "run ", run.run, el("span", { class: "muted" },
      " · " + run.ranks.length + " rank" + (run.ranks.length === 1 ? "" : "s") + " here")));
  for (const v of run.verdicts) {
    const ranks = run.ranks.length > 1 ? " (rank " + v.ranks.join(", ") + ")" : "";
    card.append(
      el("p", { class: "verdict", "data-verdict": v.verdict }, v.summary, " ",
         el("code", {}, v.verdict + ranks)),
      el("p", { class: "muted" }, v.reason,
         ...(v.also.length ? ["; also found: ", ...v.also.map((a, i) =>
           el("span", { "data-also": a }, (i ? ", " : "") + a))] : [])),
      el("p", { class: "advice" }, el("b", {}, "What to change: "), v.advice));
  }
  card.append(el("p", { class: "numbers" },
    "samples/s ", el("b", {}, num(run.samples_per_second, 1)),
    " · MFU ", el("b", {}, pct(run.mfu)),
    " · goodput ", el("b", {}, pct(run.goodput)),
    " · GPUs idle ", el("b", {}, num(run.gpus_idle, 2))));
  if (run.hang) card.append(el("p", { class: "hang", "data-hang": run.run }, "Hung: " + run.hang));
  if (run.partial) card.append(el("p", { class: "muted" }, "Partly visible: " + run.partial));
  const rows = run.ranks.map((r) => el("tr", { "data-rank": r.rank },
    el("td", {}, r.rank),
    el("td", {}, num(r.samples_per_second, 1)),
    el("td", {}, r.step_seconds === null ? "n/a" : num(r.step_seconds * 1000, 1) + " ms"),
    el("td", {}, pct(r.data_wait_ratio)),
    el("td", {}, pct(r.comm_exposed_ratio)),
    el("td", {}, Object.entries(r.phases).map(([p, v]) => p + " " + pct(v)).join(", ") || "—"),
    el("td", {}, pct(r.mfu)),
    el("td", {}, memory(r)),
    el("td", {}, gpuNames(r.gpus, byUuid)),
    el("td", {}, r.verdict, ...(r.regime_changed_seconds === null
      || r.regime_changed_seconds === undefined ? [] : [el("span", { class: "muted",
        "data-regime": r.rank }, " · pace changed " + ago(r.regime_changed_seconds) + " ago")])),
    lastStep(r),
    lastPush(r)));
  card.append(el("table", {}, el("thead", {}, el("tr", {},
    ...["rank", "samples/s", "step", "data wait", "comm wait", "phases", "MFU", "memory", "GPUs",
        "verdict", "last step", "last push"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...rows)));
  // beside the verdict: what py-spy saw each rank's processes run lately
  for (const r of run.ranks.filter((x) => x.stacks)) {
    card.append(el("div", { class: "stacks", "data-stacks": r.rank },
      el("p", { class: "muted" }, "rank " + r.rank + ", py-spy "
        + (r.stacks.mode === "record" ? "stacks" : "dump") + " " + ago(r.stacks.age_seconds)
        + " ago:"),
      el("ul", {}, ...r.stacks.lines.map((line) => el("li", {}, el("code", {}, line))))));
  }
  return card;
}

// A rank's process-tree memory as the leak rule judges it: PSS, or RSS where PSS is unreadable.
function memory(r) {
  if (r.memory_bytes === null || r.memory_bytes === undefined) return "n/a";
  return bytes(r.memory_bytes) + (r.memory_measure === "pss" ? " PSS" : " RSS (no PSS)");
}

const PARTS = ["data_loading", "forward", "backward", "optimizer", "other", "idle"];
const PART_NAMES = { data_loading: "data", forward: "forward", backward: "backward",
                     optimizer: "optimizer", other: "other", idle: "idle" };

// One profile: where the mean profiled step's time went, as a stacked bar and in words.
function profileRow(p, now) {
  const cells = [el("td", {}, p.run + "/" + p.rank),
    el("td", {}, p.trigger === "cli" ? "gputrain-exporter profile" : p.trigger.slice(6)),
    el("td", { class: "state-" + p.state }, p.state),
    el("td", {}, ago(now - (p.finished || p.requested)) + " ago")];
  const stacks = p.kind === "stacks";
  if (p.state !== "done") {
    cells.push(el("td", { colspan: 3, class: "muted" }, p.error ||
      (p.state !== "running" ? "waiting for the rank" : stacks ? "py-spy " + p.mode
       : "recording " + p.steps + " steps")));
    return el("tr", { "data-profile": p.id }, ...cells);
  }
  if (stacks) {  // py-spy: each role's functions, or where each thread is; the file
    cells.push(el("td", { colspan: 2, "data-stacks-lines": "" },
      ...p.lines.map((line) => el("div", {}, el("code", {}, line)))),
      el("td", {}, el("code", {}, p.file), p.file ? " (" + bytes(p.file_bytes) + ")" : ""));
    return el("tr", { "data-profile": p.id }, ...cells);
  }
  const m = p.mean;
  const stack = el("div", { class: "stack", title: PARTS.map((k) =>
    PART_NAMES[k] + " " + pct(m[k] / m.seconds)).join(", ") });
  for (const k of PARTS) {
    const seg = el("div", { class: "seg " + k });
    seg.style.width = (m.seconds ? 100 * m[k] / m.seconds : 0).toFixed(1) + "%";
    stack.append(seg);
  }
  const top = PARTS.reduce((a, b) => (m[b] > m[a] ? b : a));
  const op = p.top_ops[0];
  cells.push(el("td", {}, stack, " ", el("span", { "data-top-part": top },
      PART_NAMES[top] + " " + pct(m.seconds ? m[top] / m.seconds : null)),
      " of " + num(m.seconds * 1000, 1) + " ms"
      + (m.gpu_busy !== undefined ? " · GPU busy " + pct(m.gpu_busy / m.seconds) : "")),
    el("td", {}, op ? op.name : "—"),
    el("td", { class: "trace" }, el("code", {}, p.trace), " (" + bytes(p.trace_bytes) + ")"));
  return el("tr", { "data-profile": p.id }, ...cells);
}

function hostRows(h) {
  const memUsed = h.memory_total_bytes && h.memory_available !== null
    ? 1 - h.memory_available / h.memory_total_bytes : null;
  const row = (k, ...v) => el("tr", {}, el("th", {}, k), el("td", {}, ...v));
  return [
    row("CPU", bar(h.cpu_busy, pct(h.cpu_busy) + " busy", "none", true),
        " iowait " + pct(h.iowait) + (h.cpus ? " · " + h.cpus + " CPUs" : "")),
    row("Memory", bar(memUsed, bytes(h.memory_available) + " available", "none", true),
        " of " + bytes(h.memory_total_bytes)),
    row("Disk", "read " + rate(h.disk_read_bytes_per_second) + " · write "
        + rate(h.disk_written_bytes_per_second) + " · busiest disk " + pct(h.disk_busy)),
    row("Network", "receive " + rate(h.network_received_bytes_per_second) + " · send "
        + rate(h.network_transmitted_bytes_per_second) + " · busiest link receiving "
        + pct(h.network_rx_used)),
  ];
}

// The node's faults and health findings (a lost GPU, Xid or memory errors, a failing
// collector, memory near its limit), whoever uses the GPU: they outrank every verdict.
function faultRows(faults) {
  return faults.map((f) => el("div", { class: "card fault " + f.severity, "data-fault": f.verdict },
    el("p", { class: "verdict" }, (f.gpu === null ? "Node: " : "GPU " + f.gpu + ": ") + f.summary,
       " ", el("code", {}, f.verdict + " · " + f.severity)),
    el("p", { class: "muted" }, f.reason),
    el("p", { class: "advice" }, el("b", {}, "What to do: "), f.advice)));
}

function draw(s) {
  if (s.bands && s.bands.busy) bands = s.bands.busy;
  document.getElementById("instance").textContent = s.instance ? "on " + s.instance : "";
  document.title = "gputrain-exporter" + (s.instance ? " · " + s.instance : "");
  document.getElementById("meta").textContent =
    s.backend + " backend" + (s.driver_version ? ", driver " + s.driver_version : "")
    + " · verdicts over the last " + ago(Math.min(s.seconds_seen, s.window_seconds))
    + " · updated " + new Date(s.time * 1000).toLocaleTimeString();
  const runs = document.getElementById("runs");
  const faults = s.faults || [];
  document.getElementById("faults-section").hidden = faults.length === 0;
  document.getElementById("faults").replaceChildren(...faultRows(faults));
  const byUuid = Object.fromEntries(s.gpus.map((g) => [g.uuid, g]));
  runs.replaceChildren(...(s.runs.length ? s.runs.map((r) => runCard(r, byUuid)) :
    [el("p", { class: "muted" },
    "No training run is pushing to this daemon. Add the client to the training loop "
    + "(README, \"Instrument your training loop\") and its verdict appears here.")]));
  const gpus = document.querySelector("#gpus tbody");
  gpus.replaceChildren(...s.gpus.map(gpuRow));
  const nogpu = document.getElementById("nogpu");
  nogpu.hidden = s.gpus.length > 0;
  nogpu.textContent = s.gpu_error ? "No GPU can be read: " + s.gpu_error
    + ". Host metrics only." : "No GPU.";
  document.getElementById("gpus").hidden = s.gpus.length === 0;
  document.querySelector("#host tbody").replaceChildren(...hostRows(s.host));
  const profiles = s.profiles || [];
  document.getElementById("profiles-section").hidden = profiles.length === 0;
  document.querySelector("#profiles tbody").replaceChildren(
    ...profiles.map((p) => profileRow(p, s.time)));
}

// The first frame comes with the page (a data block the server fills in), so the first
// paint already shows the node; then the page polls.
function drawInitial() {
  const block = document.getElementById("initial-status");
  if (!block) return false;
  try {
    draw(JSON.parse(block.textContent));
  } catch (err) {
    return false;
  }
  lastOk = new Date();
  document.body.dataset.ready = "1";
  return true;
}

async function refresh() {
  const banner = document.getElementById("banner");
  try {
    const r = await fetch("api/v1/status", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    draw(await r.json());
    lastOk = new Date();
    banner.hidden = true;
    document.body.dataset.ready = "1";
  } catch (err) {
    banner.hidden = false;
    banner.className = "banner down";
    banner.textContent = "Cannot reach the daemon (" + err.message + ")"
      + (lastOk ? "; showing what it said at " + lastOk.toLocaleTimeString() : "") + ".";
  }
  setTimeout(refresh, REFRESH_MS);
}

if (drawInitial()) setTimeout(refresh, REFRESH_MS); else refresh();
