// The dashboard's page: the runs list at /, a run at /runs/<kind>/<id>. It asks the server for
// JSON every POLL_MS and redraws what changed; the charts are plotly's (served by skyward).
"use strict";

const POLL_MS = 1000;
const PAGE_ROWS = 100;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

async function getJSON(path) {
  const response = await fetch(path, { credentials: "same-origin" });
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

// A titled part of a run's page (a region named by its heading, for screen readers too).
function section(heading, ...children) {
  const id = `section-${heading.toLowerCase()}`;
  return el("section", { "aria-labelledby": id }, el("h2", { id }, heading), ...children);
}

function clock(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const whole = Math.max(0, Math.floor(seconds));
  if (whole < 60) return `${whole}s`;
  if (whole < 3600) return `${Math.floor(whole / 60)}m${String(whole % 60).padStart(2, "0")}s`;
  return `${Math.floor(whole / 3600)}h${String(Math.floor((whole % 3600) / 60)).padStart(2, "0")}m`;
}

function dollars(value) {
  if (value === null || value === undefined) return "-";
  return `$${value.toFixed(value < 1 && value > 0 ? 4 : 2)}`;
}

function when(stamp) {
  return stamp ? new Date(stamp * 1000).toLocaleString() : "-";
}

function stateBadge(row) {
  const said = row.state === "failed" && row.reason ? `failed (${row.reason})` : row.state;
  return el("span", { class: `state ${row.state}`, title: row.reason || "" }, said);
}

// -- the runs list ------------------------------------------------------------------------

function showList(main) {
  document.title = "skyward: runs";
  const filter = el("input", { id: "filter", placeholder: "Filter by name, provider, state…",
                               "aria-label": "Filter runs" });
  const body = el("tbody");
  const more = el("p", { class: "quiet" });
  let shown = PAGE_ROWS;
  let rows = [];
  const head = el("tr", {}, ...["Name", "Kind", "Provider", "Nodes", "State", "Started",
    "Duration", "$/hour", "Cost"].map((h) => el("th", {}, h)));
  main.replaceChildren(el("h1", {}, "Runs"), filter, el("table", {}, el("thead", {}, head), body),
                       more);

  function draw() {
    const words = filter.value.trim().toLowerCase();
    const matching = rows.filter((r) => !words ||
      `${r.name} ${r.id} ${r.provider} ${r.state} ${r.kind} ${r.script}`.toLowerCase()
        .includes(words));
    body.replaceChildren(...matching.slice(0, shown).map((r) => el("tr", {},
      el("td", {}, el("a", { href: `/runs/${r.kind}/${encodeURIComponent(r.id)}` }, r.name)),
      el("td", {}, r.kind === "pool" ? "pool" : "detached run"),
      el("td", {}, r.provider),
      el("td", { class: "num" }, r.ranks_per_node > 1 ? `${r.nodes} × ${r.ranks_per_node}`
                                                      : String(r.nodes)),
      el("td", {}, stateBadge(r)),
      el("td", {}, when(r.started)),
      el("td", { class: "num" }, clock(r.duration)),
      el("td", { class: "num" }, dollars(r.per_hour)),
      el("td", { class: "num" }, dollars(r.cost)))));
    more.replaceChildren();
    if (!rows.length) more.append("No runs yet: a pool's script or `skyward run` adds one.");
    if (matching.length > shown) {
      more.append(`${shown} of ${matching.length} shown. `,
        el("button", { onclick: () => { shown += PAGE_ROWS; draw(); } }, "Show more"));
    }
  }
  filter.addEventListener("input", () => { shown = PAGE_ROWS; draw(); });

  async function poll() {
    try {
      rows = await getJSON("/api/runs");
      draw();
    } catch (error) {
      more.textContent = `The dashboard's server does not answer: ${error.message}`;
    }
    setTimeout(poll, POLL_MS);
  }
  poll();
}

// -- one run -------------------------------------------------------------------------------

function showRun(main, kind, id) {
  const api = `/api/runs/${kind}/${encodeURIComponent(id)}`;
  const title = el("h1", {}, id);
  const facts = el("p", { class: "facts" });
  const stop = el("button", { class: "stop", hidden: "" }, "Stop");
  const stopSaid = el("span", { class: "quiet" });
  const charts = el("div");
  const noCharts = el("p", { class: "quiet" }, "Nothing reported with sky.report yet.");
  const events = el("ol", { id: "events" });
  const checkpoints = el("ul");
  const noCheckpoints = el("p", { class: "quiet" }, "No checkpoint reported.");
  const output = el("pre", { id: "output" });
  const downloads = el("p", {}, "Metrics: ",
    el("a", { href: `${api}/metrics.csv` }, "CSV"), " · ",
    el("a", { href: `${api}/metrics.jsonl` }, "JSON Lines"));
  main.replaceChildren(title, facts, el("p", {}, stop, " ", stopSaid),
    section("Metrics", noCharts, charts, downloads),
    section("Events", events),
    section("Checkpoints", noCheckpoints, checkpoints),
    section("Output", output));

  const seen = { events: 0, metrics: 0, output: 0 };
  const series = new Map();  // metric -> Map(who -> {x: [], y: []})
  const plotted = new Map(); // metric -> its div
  let running = false;
  let revision = 0;

  stop.addEventListener("click", async () => {
    if (!window.confirm(`Stop ${title.textContent}? Every rank on every node is ended.`)) return;
    stop.disabled = true;
    stopSaid.textContent = "stopping…";
    const response = await fetch(`${api}/stop`, { method: "POST", credentials: "same-origin" });
    const answer = await response.json();
    stopSaid.textContent = answer.said || answer.error;
  });

  function addMetrics(found) {
    const changed = new Set();
    for (const entry of found) {
      const step = typeof entry.metrics.step === "number" ? entry.metrics.step : null;
      if (entry.checkpoint) {
        checkpoints.append(el("li", {}, `${when(entry.time)} (${entry.who}) ${entry.checkpoint}`));
        noCheckpoints.hidden = true;
      }
      for (const [key, value] of Object.entries(entry.metrics)) {
        if (key === "step" || typeof value !== "number") continue;
        if (!series.has(key)) series.set(key, new Map());
        const lines = series.get(key);
        if (!lines.has(entry.who)) lines.set(entry.who, { x: [], y: [] });
        const line = lines.get(entry.who);
        line.x.push(step !== null ? step : new Date(entry.time * 1000));
        line.y.push(value);
        changed.add(key);
      }
    }
    for (const key of changed) {
      if (!plotted.has(key)) {
        const div = el("div", { class: "chart", "data-metric": key });
        charts.append(div);
        plotted.set(key, div);
      }
      const traces = [...series.get(key)].map(([who, line]) => ({
        x: line.x, y: line.y, name: who, mode: "lines", type: "scatter" }));
      revision += 1;  // the arrays grew in place: tell plotly the data changed
      Plotly.react(plotted.get(key), traces, {
        datarevision: revision,
        title: { text: key }, margin: { t: 40, r: 20, b: 40, l: 60 },
        xaxis: { title: { text: traces[0] && typeof traces[0].x[0] === "number" ? "step" : "time" } },
        yaxis: { title: { text: key } }, showlegend: true,
      }, { responsive: true, displaylogo: false });
    }
    if (plotted.size) noCharts.hidden = true;
  }

  async function poll() {
    try {
      const row = await getJSON(api);
      title.textContent = row.name;
      document.title = `skyward: ${row.name}`;
      facts.replaceChildren(stateBadge(row),
        el("span", {}, `${row.kind === "pool" ? "pool" : "detached run"} on ${row.provider}`),
        el("span", {}, `${row.nodes} node(s)` +
          (row.ranks_per_node > 1 ? ` × ${row.ranks_per_node} ranks` : "")),
        el("span", {}, `started ${when(row.started)}`),
        el("span", {}, `for ${clock(row.duration)}`),
        el("span", {}, `${dollars(row.per_hour)}/hour`),
        el("span", {}, `cost ${dollars(row.cost)}`));
      if (row.reason) facts.append(el("span", { class: "quiet" }, row.reason));
      running = row.state === "running" || row.state === "starting";
      stop.hidden = !running;
      for (const what of ["events", "metrics", "output"]) {
        const found = await getJSON(`${api}/${what}?after=${seen[what]}`);
        if (!found.length) continue;
        seen[what] = found[found.length - 1].n;
        if (what === "events") {
          events.append(...found.map((e) => el("li", {}, `${when(e.time)}  ${e.text}`)));
        } else if (what === "metrics") {
          addMetrics(found);
        } else {
          const bottom = output.scrollTop + output.clientHeight >= output.scrollHeight - 4;
          output.append(found.map((l) => `(${l.who}) ${l.line}\n`).join(""));
          if (bottom) output.scrollTop = output.scrollHeight;
        }
      }
    } catch (error) {
      facts.textContent = `The dashboard's server does not answer: ${error.message}`;
    }
    setTimeout(poll, POLL_MS);
  }
  poll();
}

const main = document.getElementById("main");
const match = location.pathname.match(/^\/runs\/(pool|detached)\/(.+)$/);
if (match) showRun(main, match[1], decodeURIComponent(match[2]));
else showList(main);
