// The curves view in the browser: draws the widget's whole state with plotly.js, again on every
// change of that state and when the view's width changes (its columns and legend rows follow the width).

const PANEL_HEIGHT = 250;
// A panel's legend: rows of entries between its title and its plot, each row a plotly legend of its own
// no wider than the panel (plotly wraps a horizontal legend at the whole figure's width, which runs it
// into the next panel); entry widths estimated from the labels at the legend's font, generously.
const LEGEND_ROW = 30, LEGEND_PAD = 2, ENTRY_PX = 46, CHAR_PX = 6; // pixels (a row of plotly's legend is 29 high)
const MARGIN = { l: 56, r: 56, t: 28, b: 36 };
// A fork's label: one per step forked at (the forks of that step named together), each a row lower than
// the one before, so that no two overprint.
const FORK_LABEL_ROW = 0.09, FORK_LABEL_ROWS = 8; // of a panel's height; the ninth step's label starts at the top again
const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"];
// In a comparison a colour is a run; a run's metrics in one panel differ by line style ("dot" is the right axis's).
const DASHES = ["solid", "dash", "dashdot", "longdash"];

function loadPlotly(model) {
  if (!globalThis.__grpoLabPlotly) {
    globalThis.__grpoLabPlotly = (async () => {
      const ref = model.get("_library");
      const library = await model.widget_manager.get_model(ref.slice("IPY_MODEL_".length));
      const module = { exports: {} };
      new Function("module", "exports", library.get("source"))(module, module.exports);
      return module.exports;
    })();
    globalThis.__grpoLabPlotly.catch(() => { globalThis.__grpoLabPlotly = null; });
  }
  return globalThis.__grpoLabPlotly;
}

function floats(view) {
  // The buffers arrive as DataViews at any byte offset; copy into an aligned Float64Array.
  const bytes = new Uint8Array(view.buffer, view.byteOffset, view.byteLength).slice();
  return new Float64Array(bytes.buffer);
}

const LABELS = {
  frac_reward_zero_std: "groups with equal rewards",
  "dynamic_sampling/frac_groups_dropped_too_easy": "dropped: too easy",
  "dynamic_sampling/frac_groups_dropped_too_hard": "dropped: too hard",
  "dynamic_sampling/frac_groups_filled": "filled in (no signal)",
  "dynamic_sampling/rounds": "rounds",
  "dynamic_sampling/tokens_per_kept_group": "tokens per kept group",
  "async_generation/trainer_wait": "trainer waited for the batch",
  "async_generation/generator_idle": "generator idle",
  "async_generation/staleness": "staleness",
};

function shortName(name) {
  if (LABELS[name]) return LABELS[name];
  if (/^rewards\/.*\/mean$/.test(name)) return name.slice("rewards/".length, -"/mean".length);
  return name.replace(/^completions\//, "").replace(/^clip_ratio\//, "");
}

function wrap(text, width) {
  const lines = [];
  let line = "";
  for (const word of text.split(" ")) {
    if (line && line.length + word.length + 1 > width) { lines.push(line); line = word; } else { line = line ? `${line} ${word}` : word; }
  }
  if (line) lines.push(line);
  return lines.join("<br>");
}

function lineDash(s, metrics) {
  if (s.evaluation) return "dash";
  if (s.right) return "dot";
  return s.run_name == null ? "solid" : DASHES[metrics.indexOf(s.name) % DASHES.length];
}

function columnsFor(width) {
  return width >= 1050 ? 3 : width >= 640 ? 2 : 1;
}

function legendRows(labels, widthPx) {
  // Greedy rows of legend entries (indices into ``labels``) that each fit ``widthPx``; at least one a row.
  const rows = [];
  let row = [], used = 0;
  labels.forEach((label, i) => {
    const width = ENTRY_PX + CHAR_PX * String(label).replace(/<[^>]*>/g, "").replace(/&[a-z]+;/g, "x").length;
    if (row.length && used + width > widthPx) { rows.push(row); row = []; used = 0; }
    row.push(i);
    used += width;
  });
  if (row.length) rows.push(row);
  return rows;
}

function panelTraces(panel, arrays, xa, ya, right, withLegend) {
  // The traces of one panel (their legend ids are set by the caller) and the lowest finite value drawn.
  const data = [];
  let finiteMin = Infinity;
  const metrics = [...new Set(panel.series.map((s) => s.name))];
  // A comparison's panel of several metrics names each run (its colour) and each metric (its line
  // style) once in its legend, not every pair of them.
  const keyed = metrics.length > 1 && panel.series.some((s) => s.run_name != null);
  const named = new Set();
  panel.series.forEach((s, i) => {
    const x = floats(arrays[s.x]), y = floats(arrays[s.y]);
    if (!s.right) for (const v of y) if (Number.isFinite(v) && v < finiteMin) finiteMin = v;
    const colour = COLOURS[(s.run ?? i) % COLOURS.length];
    const common = { xaxis: xa, yaxis: s.right ? right : ya, showlegend: withLegend };
    if (s.spread !== null) {
      const spread = floats(arrays[s.spread]);
      data.push({ ...common, type: "scatter", mode: "lines", x, y: y.map((v, j) => v - spread[j]), line: { width: 0 },
                  hoverinfo: "skip", showlegend: false, name: `${shortName(s.name)} − std` });
      data.push({ ...common, type: "scatter", mode: "lines", x, y: y.map((v, j) => v + spread[j]), line: { width: 0 },
                  fill: "tonexty", fillcolor: "rgba(31,119,180,0.18)", hoverinfo: "skip", name: `± ${shortName(s.name)}_std (the whole batch)` });
    }
    const metric = s.evaluation ? `${s.evaluation} ${shortName(s.name.slice(s.evaluation.length + 1))}` : shortName(s.name);
    const run = s.run_name == null ? null : escapeHtml(s.run_name);
    data.push({
      ...common, type: "scatter", mode: "lines+markers", x, y, name: (run ?? metric) + (s.right && !keyed ? " (right axis)" : ""),
      showlegend: common.showlegend && !(keyed && named.has(s.run)), legendgroup: run === null ? undefined : `run ${s.run}`,
      marker: { size: s.evaluation ? 7 : 4, color: colour, symbol: s.evaluation ? "diamond" : "circle" },
      line: { color: colour, width: 1.5, dash: lineDash(s, metrics) },
      connectgaps: false, hovertemplate: `step %{x}: %{y:.4g}<extra>${run === null ? "" : `${run}: `}${s.name}</extra>`,
    });
    named.add(s.run);
  });
  if (keyed) {
    for (const name of metrics) {
      const s = panel.series.find((t) => t.name === name);
      data.push({ xaxis: xa, yaxis: s.right ? right : ya, type: "scatter", mode: "lines", x: [null], y: [null],
                  name: shortName(name) + (s.right ? " (right axis)" : ""), hoverinfo: "skip", showlegend: withLegend,
                  line: { color: "#7f7f7f", width: 1.5, dash: lineDash(s, metrics) } });
    }
  }
  const bad = panel.series.flatMap((s) => s.nonfinite.map((step) => [step, s.name]));
  if (bad.length) {
    data.push({
      xaxis: xa, yaxis: ya, type: "scatter", mode: "markers", name: "NaN / inf", showlegend: withLegend,
      x: bad.map((b) => b[0]), y: bad.map(() => (Number.isFinite(finiteMin) ? finiteMin : 0)),
      marker: { symbol: "x", size: 9, color: "#d62728" }, text: bad.map((b) => `${b[1]} is not finite`),
      hovertemplate: "step %{x}: %{text}<extra></extra>",
    });
  }
  return data;
}

function figure(spec, arrays, columns, widthPx) {
  const data = [];
  const layout = {
    font: { size: 10 }, plot_bgcolor: "white", paper_bgcolor: "white", showlegend: true, hovermode: "closest",
    margin: MARGIN, annotations: [], shapes: [],
  };
  let legends = 0; // plotly names its legends "legend", "legend2", "legend3"...
  const newLegend = () => (legends++ === 0 ? "legend" : `legend${legends}`);
  const panels = spec.panels;
  const rows = Math.max(1, Math.ceil(panels.length / columns));
  layout.height = rows * PANEL_HEIGHT + 20;
  const hGap = columns > 1 ? 0.08 : 0, vGap = 70 / layout.height;
  const cellW = (1 - hGap * (columns - 1)) / columns, cellH = (1 - vGap * (rows - 1)) / rows;
  const cellPx = cellW * Math.max(200, widthPx - MARGIN.l - MARGIN.r);
  const forkSteps = [...new Set((spec.forks || []).map((f) => f.step))].sort((a, b) => a - b);
  panels.forEach((panel, k) => {
    const row = Math.floor(k / columns), col = k % columns;
    const x0 = col * (cellW + hGap), y1 = 1 - row * (cellH + vGap);
    // plotly names the first axes "x" and "y", then "x2", "y2", ...; right-hand axes come after the panels'.
    const n = k === 0 ? "" : String(k + 1), rightN = String(panels.length + k + 1);
    const xa = `x${n}`, ya = `y${n}`, right = `y${rightN}`;
    const lines = panel.series.length + panel.series.filter((s) => s.spread !== null).length;
    const traces = panelTraces(panel, arrays, xa, ya, right, lines > 1);
    data.push(...traces);
    // The legend sits in a band of its own between the title and the plot, never over the lines, in rows
    // that each fit the panel's width.
    const entries = traces.filter((t) => t.showlegend);
    const legendRowsOf = entries.length ? legendRows(entries.map((t) => t.name), cellPx) : [];
    const band = legendRowsOf.length ? (legendRowsOf.length * LEGEND_ROW + LEGEND_PAD) / layout.height : 0;
    const xDomain = [x0, x0 + cellW], yDomain = [y1 - cellH, y1 - band];
    legendRowsOf.forEach((members, r) => {
      const id = newLegend();
      if (r === 0) for (const t of traces) t.legend = id; // those out of the legend too: a double-click isolates within one
      for (const i of members) entries[i].legend = id;
      layout[id] = {
        x: xDomain[0], y: y1 - (r * LEGEND_ROW) / layout.height, xref: "paper", yref: "paper", xanchor: "left",
        yanchor: "top", font: { size: 9 }, orientation: "h", tracegroupgap: 0,
      };
    });
    layout[`xaxis${n}`] = { domain: xDomain, anchor: ya, title: { text: "optimizer step", standoff: 4 }, automargin: false };
    layout[`yaxis${n}`] = {
      domain: yDomain, anchor: xa, title: { text: panel.unit, standoff: 2 }, tickformat: ".3~g", exponentformat: "e",
      ...(panel.y_range ? { range: panel.y_range, autorange: false } : { autorange: true }),
    };
    if (panel.right_range) {
      layout[`yaxis${rightN}`] = {
        overlaying: ya, anchor: xa, side: "right", tickformat: ".3~g", showgrid: false, tickmode: "auto", nticks: 4,
        range: panel.right_range, autorange: false, title: { text: panel.right_unit, standoff: 2 },
      };
    }
    layout.annotations.push({
      text: `<b>${panel.title}</b>`, x: (xDomain[0] + xDomain[1]) / 2, y: y1, xref: "paper", yref: "paper",
      xanchor: "center", yanchor: "bottom", showarrow: false, font: { size: 11 },
    });
    if (panel.note) {
      layout.annotations.push({
        text: wrap(panel.note, Math.round(45 * cellW * columns)), x: (xDomain[0] + xDomain[1]) / 2,
        y: (yDomain[0] + yDomain[1]) / 2, xref: "paper", yref: "paper", showarrow: false, align: "center",
        font: { size: 10, color: "#8a5a00" }, bgcolor: "rgba(255,244,224,0.9)",
      });
    }
    for (const mark of spec.marks) {
      layout.shapes.push({ type: "line", xref: xa, yref: `${ya} domain`, x0: mark.step, x1: mark.step, y0: 0, y1: 1,
                           line: { color: "#7f7f7f", width: 1, dash: "dot" } });
      layout.annotations.push({ text: "✎", x: mark.step, y: 1, xref: xa, yref: `${ya} domain`, showarrow: false,
                                yanchor: "top", font: { size: 11, color: "#555" }, hovertext: `step ${mark.step}: ${mark.text}` });
    }
    for (const fork of spec.forks || []) {
      layout.shapes.push({ type: "line", xref: xa, yref: `${ya} domain`, x0: fork.step, x1: fork.step, y0: 0, y1: 1,
                           line: { color: COLOURS[fork.run % COLOURS.length], width: 1.5, dash: "dash" } });
    }
    forkSteps.forEach((step, level) => {
      const here = spec.forks.filter((f) => f.step === step);
      const names = here.map((f) => `<span style="color:${COLOURS[f.run % COLOURS.length]}">${escapeHtml(f.name)}</span>`);
      layout.annotations.push({
        text: `forked: ${names.join(", ")}`, x: step, y: 1 - (level % FORK_LABEL_ROWS) * FORK_LABEL_ROW, xref: xa, yref: `${ya} domain`,
        showarrow: false, xanchor: "left", yanchor: "top", font: { size: 9, color: "#555" },
        hovertext: `${here.map((f) => escapeHtml(f.name)).join(", ")} forked at step ${step}`,
      });
    });
  });
  return { data, layout };
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

async function render({ model, el }) {
  el.classList.add("grpo-curves-plot");
  el.style.width = "100%";
  const header = document.createElement("div");
  header.className = "grpo-curves-header";
  const plot = document.createElement("div");
  plot.style.width = "100%";
  el.append(header, plot);

  const Plotly = await loadPlotly(model);
  let pending = false, drawn = false;
  const draw = () => {
    pending = false;
    const spec = model.get("spec");
    const arrays = model.get("arrays");
    const marks = spec.marks || [];
    const parts = [];
    if (spec.steps) parts.push(`<b>${spec.steps}</b> optimizer step(s)`);
    if (marks.length) parts.push(`config edits at step ${marks.map((m) => m.step).join(", ")} (✎, hover for values)`);
    const forks = spec.forks || [];
    if (forks.length) parts.push(`forked: ${forks.map((f) => `${escapeHtml(f.name)} at step ${f.step}`).join(", ")}`);
    if ((spec.constant || []).length) parts.push(`constant so far, not drawn: ${spec.constant.map(escapeHtml).join(", ")}`);
    header.innerHTML = spec.panels && spec.panels.length ? parts.join(" · ") : escapeHtml(spec.empty_text || "");
    if (!spec.panels || !spec.panels.length) {
      if (drawn) { Plotly.purge(plot); drawn = false; }
      return;
    }
    const { data, layout } = figure(spec, arrays, columnsFor(el.clientWidth || 1000), el.clientWidth || 1000);
    Plotly.react(plot, data, layout, { displayModeBar: false, responsive: true });
    drawn = true;
  };
  const schedule = () => { if (!pending) { pending = true; requestAnimationFrame(draw); } };
  model.on("change:spec", schedule);
  model.on("change:arrays", schedule);
  // A new width can change the columns and how many entries a legend row holds: drawn again, once a frame.
  const resize = new ResizeObserver(() => {
    if (drawn && !pending) { pending = true; requestAnimationFrame(draw); }
  });
  resize.observe(el);
  draw();
  return () => {
    resize.disconnect();
    model.off("change:spec", schedule);
    model.off("change:arrays", schedule);
    if (drawn) Plotly.purge(plot);
  };
}

export default { render };
