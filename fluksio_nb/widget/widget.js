// The front end of fluksio_nb's widgets: a claim's status and the machine's monitor.
//
// One dependency-free ES module, loaded by anywidget as it is committed: no
// build step, nothing fetched from anywhere. It draws what the kernel sends
// and decides nothing; every number arrives worked out (see facts.py).
//
// Labels, messages and user names come from people. They are only ever set
// with textContent (or as attribute values), never parsed as HTML.

const SVG = "http://www.w3.org/2000/svg";

// Views of the monitor ping this often, so the kernel can tell that someone
// is still looking (its lease is 90 s of the kernel's idle time). Rarely,
// because each message costs the kernel a few milliseconds of its main thread.
const PING_MS = 30000;
// A monitor that heard nothing this long is stale: while anyone watches, the
// kernel sends a point of the machine's history every 2 s, from a thread of
// its own, busy or not. Its kernel shut down, restarted or died, the monitor
// would otherwise go on showing the last figures, kernel RSS included, as live.
const STALE_MS = 15000;

// RSS at or above this share of the budget turns the bar amber.
const NEAR_BUDGET = 0.8;

function h(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function put(parent, ...children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    parent.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return parent;
}

// Bytes as the Python side writes them (pydantic's decimal units): "1.2GB".
function human(bytes) {
  if (bytes === null || bytes === undefined) return "-";
  let n = Math.max(0, Number(bytes));
  if (n < 1000) return `${Math.round(n)}B`;
  for (const unit of ["KB", "MB", "GB", "TB", "PB"]) {
    n /= 1000;
    if (n < 1000 || unit === "PB") return `${n.toFixed(1)}${unit}`;
  }
  return `${n}B`;
}

function clock(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  const hours = Math.floor(s / 3600);
  const mm = String(Math.floor((s % 3600) / 60)).padStart(2, "0");
  const ss = String(s % 60).padStart(2, "0");
  return hours ? `${hours}:${mm}:${ss}` : `${mm}:${ss}`;
}

// A measured span, as fluksio_nb/vocabulary.py and the panel's format.ts say it:
// `0.4 s`, `12 s`, `2 min 5 s`, `1 h 3 min`.
function duration(seconds) {
  const s = Math.max(0, Number(seconds) || 0);
  const tenths = Math.floor(s * 10 + 0.5) / 10;
  if (tenths < 10) return `${tenths.toFixed(1)} s`;
  const whole = Math.floor(s + 0.5);
  if (whole < 60) return `${whole} s`;
  const minutes = Math.floor(whole / 60);
  if (minutes < 60) return whole % 60 ? `${minutes} min ${whole % 60} s` : `${minutes} min`;
  const hours = Math.floor(minutes / 60);
  return minutes % 60 ? `${hours} h ${minutes % 60} min` : `${hours} h`;
}

// What every view says of a claim that ended before it got its share (vocabulary.NEVER_RAN).
const NEVER_RAN = "never got its share";

function percent(value) {
  return `${Math.round(Number(value) || 0)}%`;
}

// A place as people say it: 1st, 2nd, 3rd, 11th, 22nd.
function ordinal(n) {
  const tens = n % 100;
  const suffix = tens >= 10 && tens <= 20 ? "th" : { 1: "st", 2: "nd", 3: "rd" }[n % 10] || "th";
  return `${n}${suffix}`;
}

// A rough length of time, as the text form says it (overview.describe_span).
function span(seconds) {
  if (seconds < 60) return "under a minute";
  let minutes = Math.round(seconds / 60);
  if (minutes < 60) return `about ${minutes} min`;
  const hours = Math.floor(minutes / 60);
  minutes %= 60;
  return `about ${hours} h${minutes ? ` ${minutes} min` : ""}`;
}

// Epoch seconds as the wall clock reads them here, on the 24-hour clock in every
// view and locale (vocabulary.clock): 14:02:11.
function wallClock(epoch) {
  const at = new Date(epoch * 1000);
  if (Number.isNaN(at.getTime())) return "--:--:--";
  return [at.getHours(), at.getMinutes(), at.getSeconds()]
    .map((n) => String(n).padStart(2, "0"))
    .join(":");
}

// A filled bar. `fraction` is clamped to [0, 1]; `state` colours it.
function bar(fraction, state, title) {
  const outer = h("div", "fluksio-bar");
  if (state) outer.dataset.state = state;
  if (title) outer.title = title;
  const fill = h("div", "fluksio-fill");
  fill.style.width = `${(Math.min(1, Math.max(0, fraction || 0)) * 100).toFixed(1)}%`;
  outer.append(fill);
  return outer;
}

function budgetState(fraction, warnAt) {
  if (fraction >= 1) return "over";
  if (fraction >= (warnAt || NEAR_BUDGET)) return "near";
  return "ok";
}

// What holds a share to each resource, said once: "cores: own cores (affinity) ·
// memory: enforced (cgroup v1)"; why the OS does not, where it does not, on hover.
function enforcementRow(enforcement, muted) {
  const names = Object.keys(enforcement || {});
  if (!names.length) return null;
  const row = h("div", muted ? "fluksio-row fluksio-muted" : "fluksio-row");
  row.dataset.field = "enforcement";
  names.forEach((name, index) => {
    const how = enforcement[name];
    const part = h("span", "fluksio-enforcement", `${name}: ${how.label}`);
    part.dataset.by = how.by;
    if (how.why) part.title = how.why;
    put(row, index ? " · " : "held by ", part);
  });
  return row;
}

// A bar cut into one segment per holder, the rest free.
function segmented(total, parts) {
  const outer = h("div", "fluksio-bar fluksio-segmented");
  if (!(total > 0)) return outer;
  parts.forEach((part, index) => {
    if (!(part.amount > 0)) return;
    const segment = h("div", "fluksio-segment");
    segment.dataset.shade = String(index % 4);
    segment.style.width = `${((Math.min(part.amount, total) / total) * 100).toFixed(2)}%`;
    segment.title = part.title;
    outer.append(segment);
  });
  return outer;
}

// A sparkline of `values` from zero up to `ceiling` or their own maximum, whichever
// is higher. Memory uses its own maximum: against a budget most lines are flat.
function sparkline(values, ceiling, className) {
  const width = 90;
  const height = 18;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", `fluksio-spark ${className || ""}`);
  svg.setAttribute("width", String(width));
  svg.setAttribute("height", String(height));
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("aria-hidden", "true");
  const points = (values || []).map(Number).filter((v) => Number.isFinite(v));
  if (points.length < 2) return svg;
  let top = ceiling > 0 ? ceiling : 0;
  for (const v of points) top = Math.max(top, v);
  if (!(top > 0)) top = 1;
  const step = width / (points.length - 1);
  const coords = points.map(
    (v, i) => `${(i * step).toFixed(1)},${(height - 1 - (v / top) * (height - 2)).toFixed(1)}`,
  );
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", coords.join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "currentColor");
  line.setAttribute("stroke-width", "1.2");
  svg.append(line);
  return svg;
}

// A sparkline with its scale beside it: "0–1.2GB", from zero to the top it is drawn against.
function scaledSparkline(values, ceiling, className, show) {
  const points = (values || []).map(Number).filter((v) => Number.isFinite(v));
  let top = ceiling > 0 ? ceiling : 0;
  for (const v of points) top = Math.max(top, v);
  const wrap = h("span", "fluksio-sparkwrap");
  put(wrap, sparkline(points, top, className));
  if (points.length > 1) {
    const scale = h("span", "fluksio-scale", `0–${show(top)}`);
    scale.dataset.field = "scale";
    wrap.append(scale);
  }
  return wrap;
}

function field(name, value, text) {
  const span = h("span", "fluksio-value", text);
  span.dataset.field = name;
  if (value !== undefined && value !== null) span.dataset.value = String(value);
  return span;
}

// A share as the claim line and every other view spell it (queue.share_words):
// `cpus=2 (cores 0-1) gpus=1 (card 0) ram=4.0GB`; no cards, nothing said of them.
function share(allocation, budgetBytes) {
  const words = [`cpus=${allocation.cpus}`];
  if (allocation.cores && allocation.cores.length) words[0] += ` (cores ${cpuList(allocation.cores)})`;
  const gpus = allocation.gpus || [];
  if (gpus.length) {
    words.push(`gpus=${gpus.length} (${gpus.length === 1 ? "card" : "cards"} ${gpus.join(",")})`);
  }
  const ram = budgetBytes !== null && budgetBytes !== undefined ? budgetBytes : allocation.ram_bytes;
  if (ram) words.push(`ram=${human(ram)}`);
  return words.join(" ");
}

/** Core ids as Linux writes them, and as the Python side prints them: `0-3,8`. */
function cpuList(cores) {
  const runs = [];
  for (const core of [...cores].sort((a, b) => a - b)) {
    const last = runs[runs.length - 1];
    if (last && core === last[1] + 1) last[1] = core;
    else runs.push([core, core]);
  }
  return runs.map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`)).join(",");
}

// Redraws at most once a frame, however many traits changed at once.
function scheduler(draw) {
  let pending = false;
  const later =
    typeof requestAnimationFrame === "function" ? requestAnimationFrame : (f) => setTimeout(f, 16);
  return () => {
    if (pending) return;
    pending = true;
    later(() => {
      pending = false;
      draw();
    });
  };
}

function listen(model, names, callback) {
  for (const name of names) model.on(`change:${name}`, callback);
  return () => {
    for (const name of names) model.off(`change:${name}`, callback);
  };
}

// -----------------------------------------------------------------------------
// One claim
// -----------------------------------------------------------------------------

// A claim's sparkline points, kept once per model rather than per view. The
// kernel sends each new reading, and the full histories only now and then
// (when the phase changes, and every few seconds), to keep pushes small.
const POINTS = 60;

function keepPoints(model) {
  const points = { rss: [], cpu: [], n: -1 };
  const reset = () => {
    points.rss = [...(model.get("rss_history") || [])];
    points.cpu = [...(model.get("cpu_history") || [])];
    const reading = model.get("reading");
    points.n = reading ? reading.n : -1;
  };
  const add = () => {
    const reading = model.get("reading");
    if (!reading || reading.n === points.n) return;
    points.n = reading.n;
    points.rss.push(reading.rss_bytes);
    points.cpu.push(reading.cpu_percent);
    points.rss.splice(0, points.rss.length - POINTS);
    points.cpu.splice(0, points.cpu.length - POINTS);
  };
  reset();
  model.on("change:rss_history", reset);
  model.on("change:reading", add);
  // A local attribute of this page's copy of the model: never saved back.
  model.set("_points", points);
}

const CLAIM_TRAITS = [
  "label",
  "phase",
  "asked",
  "position",
  "holders",
  "waited_s",
  "share",
  "reading",
  "rss_history",
  "cpu_history",
  "elapsed_s",
  "peak_rss_bytes",
  "mean_cpu_percent",
  "gpu",
  "peak_gpu_bytes",
  "ending",
  "message",
  "enforcement",
  "memory_warning",
  "warning",
  "doing",
];

function renderClaim(model, el) {
  const root = h("div", "fluksio fluksio-claim");
  el.append(root);
  // Seconds are counted here between pushes, from when the last one came.
  let receivedAt = performance.now();
  const since = () => (performance.now() - receivedAt) / 1000;

  const draw = () => {
    const phase = model.get("phase");
    const ending = model.get("ending");
    root.dataset.phase = phase;
    root.dataset.ending = ending || "";
    // good, bad or stopped: the one colour this ending has in every view.
    root.dataset.mark = model.get("mark") || "";
    root.dataset.warning = model.get("memory_warning")
      ? "memory"
      : model.get("warning") && phase === "running"
        ? "books"
        : "";
    const head = h("div", "fluksio-head");
    const state = phase === "done" ? ending || "done" : phase;
    put(
      head,
      h("span", "fluksio-dot"),
      h("span", "fluksio-label", model.get("label")),
      h("span", "fluksio-state", state),
    );
    const body = [];
    if (phase === "waiting") {
      // The state beside it already says "waiting": the clock says for how long.
      head.append(h("span", "fluksio-clock", clock(model.get("waited_s") + since())));
      const position = model.get("position");
      body.push(
        put(
          h("div", "fluksio-row"),
          "asks ",
          field("asked", null, model.get("asked")),
          position ? ` · ${ordinal(position)} in the queue` : " · in the queue",
        ),
      );
      const holders = model.get("holders") || [];
      body.push(
        put(
          h("div", "fluksio-row fluksio-muted"),
          holders.length ? "held by " : "behind the claims ahead of it",
          holders.length ? field("holders", null, holders.join(", ")) : null,
        ),
      );
      if (model.get("doing")) {
        // When it may start, or why nobody can tell.
        body.push(h("div", "fluksio-row fluksio-doing", model.get("doing")));
      }
    } else {
      const allocation = model.get("share") || { cpus: 0, gpus: [], ram_bytes: 0 };
      const reading = model.get("reading");
      const points = model.get("_points") || { rss: [], cpu: [] };
      const rssHistory = points.rss;
      const cpuHistory = points.cpu;
      const budget = allocation.budget_bytes;
      if (phase === "running") {
        head.append(h("span", "fluksio-clock", clock(model.get("elapsed_s") + since())));
        if (model.get("doing")) {
          // Stopped by a signal, or sending its results back: not plain running.
          body.push(h("div", "fluksio-row fluksio-doing", model.get("doing")));
        }
        if (model.get("warning")) {
          // The books' word, its time limit near: above the readings, where it is read.
          body.push(h("div", "fluksio-row fluksio-books-warning", model.get("warning")));
        }
        body.push(put(h("div", "fluksio-row"), field("share", null, share(allocation, budget))));
        const rss = reading ? reading.rss_bytes : 0;
        const ceiling = budget || (reading ? reading.host_total_bytes : 0);
        const fraction = ceiling ? rss / ceiling : 0;
        body.push(
          put(
            h("div", "fluksio-meter"),
            h("span", "fluksio-name", "RSS"),
            bar(fraction, budget ? budgetState(fraction, allocation.warn_at) : "ok"),
            field(
              "rss",
              rss,
              budget
                ? `${human(rss)}/${human(budget)} used`
                : reading
                  ? `${human(rss)}/${human(ceiling)} of the host used`
                  : "no reading yet",
            ),
            scaledSparkline(rssHistory, 0, "fluksio-spark-rss", human),
          ),
        );
        const cpu = reading ? reading.cpu_percent : 0;
        body.push(
          put(
            h("div", "fluksio-meter"),
            h("span", "fluksio-name", "CPU"),
            bar(cpu / 100, "cpu"),
            field(
              "cpu",
              cpu,
              `${percent(cpu)} of the machine${reading ? ` · ${reading.cpu_cores} cores` : ""}`,
            ),
            scaledSparkline(cpuHistory, 100, "fluksio-spark-cpu", percent),
          ),
        );
        // Only where its cards were read: an unread card is not an idle one.
        if (model.get("gpu")) {
          body.push(put(h("div", "fluksio-row"), field("gpu", null, model.get("gpu"))));
        }
        body.push(enforcementRow(model.get("enforcement"), true));
      } else {
        head.append(h("span", "fluksio-clock", duration(model.get("elapsed_s"))));
        const peak = model.get("peak_rss_bytes");
        body.push(
          put(
            h("div", "fluksio-row"),
            "took ",
            field("duration", model.get("elapsed_s"), duration(model.get("elapsed_s"))),
            " · peak RSS ",
            field("peak-rss", peak, human(peak)),
            " · mean CPU ",
            field("mean-cpu", model.get("mean_cpu_percent"), percent(model.get("mean_cpu_percent"))),
            model.get("peak_gpu_bytes") !== null && model.get("peak_gpu_bytes") !== undefined
              ? put(
                  h("span"),
                  " · peak GPU ",
                  field("peak-gpu", model.get("peak_gpu_bytes"), human(model.get("peak_gpu_bytes"))),
                )
              : null,
          ),
        );
        if (model.get("share")) {
          body.push(
            put(h("div", "fluksio-row fluksio-muted"), "on ", share(allocation, budget)),
          );
          body.push(enforcementRow(model.get("enforcement"), true));
        }
        if (model.get("message")) body.push(h("div", "fluksio-message", model.get("message")));
        if (rssHistory.length > 1) {
          body.push(
            put(
              h("div", "fluksio-row fluksio-muted"),
              "RSS ",
              scaledSparkline(rssHistory, 0, "fluksio-spark-rss", human),
              " CPU ",
              scaledSparkline(cpuHistory, 100, "fluksio-spark-cpu", percent),
            ),
          );
        }
      }
    }
    root.replaceChildren(head, ...body.filter(Boolean));
  };

  const redraw = scheduler(draw);
  const onChange = () => {
    receivedAt = performance.now();
    redraw();
  };
  const stop = listen(model, CLAIM_TRAITS, onChange);
  // Only the clock moves between pushes; once done, nothing does.
  const ticking = setInterval(() => {
    if (model.get("phase") !== "done") redraw();
  }, 1000);
  draw();
  return () => {
    clearInterval(ticking);
    stop();
  };
}

// -----------------------------------------------------------------------------
// The machine
// -----------------------------------------------------------------------------

// A claim as people name it: its label. Tickets are ids for the kernel, not for reading.
function who(claim) {
  return claim.label;
}

// Ray counts in fractions of a CPU or card; whole numbers are shown whole.
function amount(n) {
  const x = Number(n) || 0;
  return Number.isInteger(x) ? String(x) : x.toFixed(2).replace(/0+$/, "");
}

// The Ray cluster this kernel is connected to, and this kernel's claims on
// it. Present only while connected: the kernel leaves `ray` out otherwise.
function rayCluster(ray, kernelNow) {
  const section = h("div", "fluksio-ray");
  section.dataset.section = "ray";
  const nodes = `${ray.nodes} node${ray.nodes === 1 ? "" : "s"}`;
  put(
    section,
    put(
      h("div", "fluksio-title"),
      "Ray cluster ",
      h("span", "fluksio-muted", `${ray.address || ""} · ${nodes}`),
    ),
  );
  const rows = h("div", "fluksio-grid");
  const resources = [
    ["cpus", "CPUs", amount],
    ["gpus", "GPUs", amount],
    ["memory_bytes", "Memory", human],
  ];
  for (const [key, name, show] of resources) {
    const total = Number(ray.total[key]) || 0;
    const free = Number(ray.available[key]) || 0;
    put(
      rows,
      h("span", "fluksio-name", name),
      bar(total ? (total - free) / total : 0, "ok", `${show(total - free)} in use`),
      field(`ray-${key}`, total - free, `${show(total - free)}/${show(total)} used`),
    );
  }
  section.append(rows);

  const claims = ray.claims || [];
  const list = h("div", "fluksio-list");
  list.dataset.list = "ray";
  put(list, h("div", "fluksio-title", `This kernel's claims on Ray (${claims.length})`));
  if (!claims.length) list.append(h("div", "fluksio-muted", "None."));
  for (const c of claims) {
    const item = h("div", "fluksio-item");
    item.dataset.phase = c.phase;
    const cards = c.gpus && c.gpus.length ? ` · GPU ${c.gpus.join(", ")}` : "";
    const since = c.phase === "running" && c.started ? c.started : c.since;
    put(
      item,
      put(
        h("div", "fluksio-row"),
        h("span", "fluksio-label", c.label),
        h("span", "fluksio-muted", ` · ${c.phase}`),
        ` · asks ${c.asked}${cards}`,
        c.node ? h("span", "fluksio-muted", ` · node ${String(c.node).slice(0, 8)}`) : null,
        since
          ? h(
              "span",
              "fluksio-clock",
              clock(kernelNow() - since),
            )
          : null,
      ),
    );
    if (c.rss_bytes !== null && c.rss_bytes !== undefined) {
      put(item, ...readingMeters(c.rss_bytes, c.budget_bytes, c.cpu_percent || 0, "its node"));
    } else if (c.phase === "running") {
      item.append(h("div", "fluksio-muted", "no readings yet"));
    }
    list.append(item);
  }
  section.append(list);
  return section;
}

// A running claim's RSS against its budget (amber near it) and its CPU as a
// share of ``where``, the same in a local claim's row and a Ray claim's.
function readingMeters(rss, ceiling, cpu, where) {
  const fraction = ceiling ? rss / ceiling : 0;
  return [
    put(
      h("div", "fluksio-meter"),
      h("span", "fluksio-name", "RSS"),
      bar(fraction, ceiling ? budgetState(fraction) : "ok"),
      field("rss", rss, ceiling ? `${human(rss)}/${human(ceiling)} used` : human(rss)),
    ),
    put(
      h("div", "fluksio-meter"),
      h("span", "fluksio-name", "CPU"),
      bar(cpu / 100, "cpu"),
      field("cpu", cpu, `${percent(cpu)} of ${where}`),
    ),
  ];
}

// The machine's history, kept once per model: the kernel sends it whole now
// and then (history) and each new point alone (history_point).
const HISTORY_SPAN_S = 600;

function keepHistory(model) {
  const kept = { points: [] };
  const add = () => {
    const point = model.get("history_point");
    const last = kept.points[kept.points.length - 1];
    if (!point || (last && point.at <= last.at)) return;
    kept.points.push(point);
    kept.points = kept.points.filter((p) => p.at >= point.at - HISTORY_SPAN_S);
  };
  const reset = () => {
    kept.points = [...(model.get("history") || [])];
    add();
  };
  reset();
  model.on("change:history", reset);
  model.on("change:history_point", add);
  // A local attribute of this page's copy of the model: never saved back.
  model.set("_history", kept);
}

// One series of the last ten minutes, against a fixed scale: 0 to `top`
// (100% for CPU, the total for memory), labelled on the left, time below.
function historyChart(name, series, top, show, now) {
  const width = 300;
  const height = 56;
  const left = 56;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", `fluksio-chart fluksio-chart-${name}`);
  svg.setAttribute("width", String(left + width + 4));
  svg.setAttribute("height", String(height + 16));
  svg.setAttribute("viewBox", `0 0 ${left + width + 4} ${height + 16}`);
  svg.setAttribute("role", "img");
  svg.dataset.field = `history-${name}`;
  const text = (x, y, words, anchor) => {
    const node = document.createElementNS(SVG, "text");
    node.setAttribute("x", String(x));
    node.setAttribute("y", String(y));
    node.setAttribute("text-anchor", anchor);
    node.setAttribute("class", "fluksio-axis");
    node.textContent = words;
    svg.append(node);
  };
  const rule = (y) => {
    const line = document.createElementNS(SVG, "line");
    line.setAttribute("x1", String(left));
    line.setAttribute("x2", String(left + width));
    line.setAttribute("y1", String(y));
    line.setAttribute("y2", String(y));
    line.setAttribute("class", "fluksio-rule");
    svg.append(line);
  };
  // 0, half and the top; ten minutes ago, five, and now: the panel's axes too.
  const middle = (1 + height) / 2;
  rule(1);
  rule(middle);
  rule(height);
  const tick = document.createElementNS(SVG, "line");
  tick.setAttribute("x1", String(left + width / 2));
  tick.setAttribute("x2", String(left + width / 2));
  tick.setAttribute("y1", "1");
  tick.setAttribute("y2", String(height));
  tick.setAttribute("class", "fluksio-rule fluksio-rule-time");
  svg.append(tick);
  text(left - 4, 10, show(top), "end");
  text(left - 4, middle + 4, show(top / 2), "end");
  text(left - 4, height, show(0), "end");
  text(left, height + 13, "10 min ago", "start");
  text(left + width / 2, height + 13, "5 min ago", "middle");
  text(left + width, height + 13, "now", "end");
  const x = (at) =>
    left + width * (1 - Math.min(HISTORY_SPAN_S, Math.max(0, now - at)) / HISTORY_SPAN_S);
  const y = (v) => height - (Math.min(top, Math.max(0, v)) / (top || 1)) * (height - 2);
  let drawn = 0;
  for (const line of series) {
    const known = line.points.filter((p) => p.value !== null && p.value !== undefined);
    if (known.length < 2) continue;
    const poly = document.createElementNS(SVG, "polyline");
    poly.setAttribute(
      "points",
      known.map((p) => `${x(p.at).toFixed(1)},${y(p.value).toFixed(1)}`).join(" "),
    );
    poly.setAttribute("class", `fluksio-line ${line.className}`);
    poly.setAttribute("fill", "none");
    svg.append(poly);
    drawn = Math.max(drawn, known.length);
  }
  svg.dataset.points = String(drawn);
  const title = document.createElementNS(SVG, "title");
  title.textContent = `${name}, the last 10 minutes, 0 to ${show(top)}`;
  svg.append(title);
  return svg;
}

function chartHead(name, fieldName, value, text, extra) {
  return put(
    h("div", "fluksio-chart-head"),
    h("span", "fluksio-name", name),
    " ",
    field(fieldName, value, text),
    extra || null,
  );
}

function bytesScale(v) {
  return v ? human(v) : "0";
}

// CPU, memory and each card read, over the last ten minutes.
function historySection(points, now) {
  const section = h("div", "fluksio-history");
  section.dataset.section = "history";
  put(section, h("div", "fluksio-title", "Last 10 minutes"));
  if (points.length < 2) {
    section.append(h("div", "fluksio-muted", "Collecting: a point every few seconds while shown."));
    return section;
  }
  const last = points[points.length - 1];
  const outside = last.cpu_outside_claims_percent;
  const known = outside !== null && outside !== undefined;
  const charts = h("div", "fluksio-charts");
  put(
    charts,
    chartHead(
      "CPU",
      "host-cpu",
      last.cpu_percent,
      `${percent(last.cpu_percent)}/100% used` +
        (known ? ` · ${percent(outside)} outside claims` : ""),
      known ? h("span", "fluksio-key-outside", " (dashed: outside claims)") : null,
    ),
    historyChart(
      "cpu",
      [
        {
          className: "fluksio-line-cpu",
          points: points.map((p) => ({ at: p.at, value: p.cpu_percent })),
        },
        {
          className: "fluksio-line-outside",
          points: points.map((p) => ({ at: p.at, value: p.cpu_outside_claims_percent })),
        },
      ],
      100,
      (v) => `${Math.round(v)}%`,
      now,
    ),
  );
  const total = last.memory_total_bytes;
  put(
    charts,
    chartHead(
      "Memory",
      "host-memory",
      last.memory_used_bytes,
      `${human(last.memory_used_bytes)}/${human(total)} used`,
    ),
    historyChart(
      "memory",
      [
        {
          className: "fluksio-line-memory",
          points: points.map((p) => ({ at: p.at, value: p.memory_used_bytes })),
        },
      ],
      total,
      bytesScale,
      now,
    ),
  );
  for (const card of last.cards || []) {
    if (!card.total_bytes) continue;
    const series = points.map((p) => {
      const found = (p.cards || []).find((c) => c.index === card.index);
      return { at: p.at, value: found ? found.used_bytes : null };
    });
    const busy = card.utilisation_percent;
    put(
      charts,
      chartHead(
        `GPU ${card.index}`,
        `card-${card.index}`,
        card.used_bytes,
        `${human(card.used_bytes)}/${human(card.total_bytes)} used` +
          (busy === null || busy === undefined ? "" : ` · ${percent(busy)} busy`),
      ),
      historyChart(
        `card-${card.index}`,
        [{ className: "fluksio-line-card", points: series }],
        card.total_bytes,
        bytesScale,
        now,
      ),
    );
  }
  section.append(charts);
  return section;
}

// The claims that ended lately, newest first: how each went, its wait, run and peaks.
function finishedList(finished) {
  const list = listOf("finished", "Finished lately", finished.length, "Nothing has finished yet.");
  for (const c of finished) {
    const item = h("div", "fluksio-item");
    item.dataset.ending = c.ending;
    item.dataset.mark = c.mark || "bad";
    const words = [`waited ${duration(c.waited_s)}`];
    const ran = c.ran_s === null || c.ran_s === undefined;
    words.push(ran ? NEVER_RAN : `ran ${duration(c.ran_s)}`);
    if (!ran && c.cpus) {
      words.push(share({ cpus: c.cpus, gpus: c.gpus || [], ram_bytes: c.ram_bytes }));
    }
    if (c.peak_rss_bytes !== null && c.peak_rss_bytes !== undefined) {
      words.push(`peak RSS ${human(c.peak_rss_bytes)}`);
    }
    if (c.peak_gpu_bytes !== null && c.peak_gpu_bytes !== undefined) {
      words.push(`peak GPU ${human(c.peak_gpu_bytes)}`);
    }
    put(
      item,
      put(
        h("div", "fluksio-row"),
        h("span", "fluksio-ending", c.ending),
        " ",
        h("span", "fluksio-label", c.label),
        whoseLine({ user: c.user, notebook: c.notebook, mine: false }),
        ` · ${words.join(" · ")}`,
        h("span", "fluksio-clock", `ended ${wallClock(c.ended_at)}`),
      ),
    );
    if (c.error) {
      // The user's own claim's error line: the server reads no one else's records.
      const error = h("div", "fluksio-row fluksio-error-line", c.error);
      error.dataset.field = "error";
      item.append(error);
    }
    list.append(item);
  }
  return list;
}

// What a waiting claim may still wait: counted down here from the kernel's guess.
function expectedText(expected, now) {
  if (!expected) return null;
  if (expected.at === null || expected.at === undefined) return expected.why;
  const left = expected.at - now;
  const when = expected.at === 0 || left < 1 ? "any moment now" : `in ${span(left)}`;
  return `expected to start ${when} (${expected.why})`;
}

// The monitor's running and waiting lists: a titled list, or a line saying it is empty.
function listOf(kind, title, count, empty) {
  const list = h("div", "fluksio-list");
  list.dataset.list = kind;
  put(list, h("div", "fluksio-title", `${title} (${count})`));
  if (!count) list.append(h("div", "fluksio-muted", empty));
  return list;
}

// A notebook by its file name; the whole path, as its kernel was told it, on hover.
function notebookName(path) {
  return String(path).split("/").pop();
}

// Whose a claim is and which notebook it serves, beside its label: " · ada · train.ipynb".
function whoseLine(claim) {
  const parts = [];
  if (claim.user && !claim.mine) parts.push(claim.user);
  if (claim.notebook) parts.push(notebookName(claim.notebook));
  if (!parts.length) return null;
  const span = h("span", "fluksio-muted", ` · ${parts.join(" · ")}`);
  span.dataset.field = "whose";
  if (claim.notebook) span.title = claim.notebook;
  return span;
}

function renderMonitor(model, el) {
  const root = h("div", "fluksio fluksio-monitor");
  el.append(root);
  // The kernel's clock, as seen from here: pushes carry its time.
  let offset = 0;
  const kernelNow = () => Date.now() / 1000 + offset;
  // When the kernel last sent anything, and whether it can no longer be told.
  let heardAt = Date.now();
  let gone = false;

  const draw = () => {
    const m = model.get("machine") || {};
    const stale = gone || Date.now() - heardAt > STALE_MS;
    root.dataset.stale = stale ? "yes" : "no";
    // Why, for whoever reads the page: its kernel said to be gone, or a silence.
    root.dataset.staleWhy = gone ? "gone" : stale ? "silent" : "";
    if (!m.cpus) {
      root.replaceChildren(h("div", "fluksio-muted", "Reading the machine…"));
      return;
    }
    const running = m.running || [];
    const waiting = m.waiting || [];
    const rows = h("div", "fluksio-grid");

    const cpuParts = running.map((c) => ({
      amount: c.allocation.cpus,
      title:
        `${who(c)}: ${c.allocation.cpus} cpus` +
        (c.allocation.cores && c.allocation.cores.length
          ? ` (cores ${cpuList(c.allocation.cores)})`
          : ""),
    }));
    put(
      rows,
      h("span", "fluksio-name", "cpus"),
      segmented(m.cpus.total, cpuParts),
      field("cpus", m.cpus.total - m.cpus.free, `${m.cpus.total - m.cpus.free}/${m.cpus.total} used`),
    );

    for (const card of m.gpus || []) {
      const cell = h("div", "fluksio-card");
      cell.dataset.held = card.holder || card.slices ? "yes" : "no";
      cell.append(
        card.slices
          ? h("span", "fluksio-holder", card.slices)
          : card.holder
            ? put(h("span", "fluksio-holder"), "held by ", h("span", "fluksio-label", who(card.holder)))
            : h("span", "fluksio-free", "free"),
      );
      if (card.card) {
        const used = card.card.used_bytes;
        const total = card.card.total_bytes;
        const busy = card.card.utilisation_percent;
        const said = [];
        if (used !== null) said.push(`${human(used)}/${human(total)} used`);
        if (busy !== null) said.push(`${percent(busy)} busy`);
        put(
          cell,
          used !== null && total ? bar(used / total, budgetState(used / total)) : null,
          h("span", "fluksio-muted", said.join(" · ")),
        );
      }
      put(rows, h("span", "fluksio-name", `GPU ${card.id}`), cell, h("span"));
    }
    // A machine without cards says nothing of them, as every view does.

    const ramParts = running.map((c) => ({
      amount: c.allocation.ram_bytes,
      title: `${who(c)}: ${human(c.allocation.ram_bytes)}`,
    }));
    put(
      rows,
      h("span", "fluksio-name", "ram"),
      segmented(m.ram.total, ramParts),
      field(
        "ram",
        m.ram.total - m.ram.free,
        `${human(m.ram.total - m.ram.free)}/${human(m.ram.total)} used`,
      ),
    );

    // The host's available memory against the headroom line: below the line,
    // running claims are halted.
    const host = m.host;
    const hostBar = bar(
      host.total ? (host.total - host.available) / host.total : 0,
      host.available < host.headroom ? "over" : host.available < 2 * host.headroom ? "near" : "ok",
      `halts below ${human(host.headroom)} available`,
    );
    hostBar.classList.add("fluksio-host");
    const line = h("div", "fluksio-headroom");
    // Past this much used, less than the headroom is left.
    line.style.left = `${(((host.total - host.headroom) / (host.total || 1)) * 100).toFixed(1)}%`;
    hostBar.append(line);
    put(
      rows,
      h("span", "fluksio-name", "Host"),
      hostBar,
      field(
        "host",
        host.total - host.available,
        `${human(host.total - host.available)}/${human(host.total)} used · ` +
          `halts past ${human(host.total - host.headroom)}`,
      ),
    );
    if (m.kernel) {
      put(
        rows,
        h("span", "fluksio-name", "Kernel"),
        h("span", "fluksio-muted", "this notebook's own memory"),
        field("kernel-rss", m.kernel.rss_bytes, `RSS ${human(m.kernel.rss_bytes)}`),
      );
    }

    const runningList = listOf("running", "Running", running.length, "Nothing running.");
    for (const c of running) {
      const item = h("div", "fluksio-item");
      item.dataset.ticket = String(c.ticket);
      const title = put(
        h("div", "fluksio-row"),
        h("span", "fluksio-label", c.label),
        whoseLine(c),
        ` · ${share(c.allocation, c.budget_bytes)}`,
        c.started ? h("span", "fluksio-clock", clock(kernelNow() - c.started)) : null,
      );
      item.append(title);
      if (c.stopped_since) {
        const stopped = h(
          "div",
          "fluksio-stopped",
          `stopped by a signal since ${wallClock(c.stopped_since)}`,
        );
        stopped.dataset.field = "stopped";
        item.append(stopped);
      }
      if (c.warning) {
        const warned = h("div", "fluksio-row fluksio-books-warning", c.warning);
        warned.dataset.field = "warning";
        item.append(warned);
      }
      if (c.reading) {
        const { rss_bytes: rss, cpu_percent: cpu } = c.reading;
        put(item, ...readingMeters(rss, c.budget_bytes, cpu, "the machine"));
      } else {
        item.append(h("div", "fluksio-muted", "no readings yet"));
      }
      if (c.gpu) item.append(put(h("div", "fluksio-row"), field("gpu", null, c.gpu)));
      runningList.append(item);
    }

    // The machine's books list only the first of other users' waiting claims:
    // the count is the whole queue's, and a line says the rest are not listed.
    const unlisted = m.waiting_unlisted || 0;
    const waitingList = listOf("waiting", "Waiting", waiting.length + unlisted, "Nobody waiting.");
    for (const c of waiting) {
      const item = h("div", "fluksio-item");
      item.dataset.ticket = String(c.ticket);
      put(
        item,
        put(
          h("div", "fluksio-row"),
          field("position", c.position, `${ordinal(c.position)} in the queue`),
          " · ",
          h("span", "fluksio-label", c.label),
          whoseLine(c),
          ` · asks ${c.asked}`,
          h("span", "fluksio-clock", `waiting ${clock(kernelNow() - c.since)}`),
        ),
      );
      const expected = expectedText(c.expected, kernelNow());
      if (expected) {
        const line = h("div", "fluksio-muted", expected);
        line.dataset.field = "expected";
        item.append(line);
      }
      waitingList.append(item);
    }
    if (unlisted) {
      const said = `and ${unlisted} more of other users' claims, not listed`;
      const more = h("div", "fluksio-item fluksio-muted", said);
      more.dataset.field = "unlisted";
      waitingList.append(more);
    }

    // Card memory no claim on that card sits above: only where that can be known.
    let squatters = null;
    if (m.squatters && m.squatters.length) {
      squatters = listOf("squatters", "Card memory held with no claim", m.squatters.length, "");
      for (const text of m.squatters) squatters.append(h("div", "fluksio-item fluksio-squatter", text));
    }

    // Through put(), which skips an absent section: replaceChildren itself
    // would draw a null as the text "null".
    root.replaceChildren();
    put(
      root,
      h("div", "fluksio-title", "Machine"),
      stale
        ? h(
            "div",
            "fluksio-stale",
            `Stale: the kernel that showed this is gone or silent; as it was ${clock((Date.now() - heardAt) / 1000)} ago. Run %claims again in a running kernel.`,
          )
        : null,
      rows,
      enforcementRow(m.enforcement, true),
      runningList,
      waitingList,
      squatters,
      finishedList(m.finished || []),
      historySection((model.get("_history") || { points: [] }).points, kernelNow()),
      m.ray ? rayCluster(m.ray, kernelNow) : null,
    );
  };

  const redraw = scheduler(draw);
  const onChange = () => {
    heardAt = Date.now();
    const m = model.get("machine") || {};
    if (m.clock) offset = m.clock - Date.now() / 1000;
    redraw();
  };
  onChange();
  const stop = listen(model, ["machine", "history", "history_point"], onChange);

  // Telling the kernel someone is looking: hello now, a ping every few
  // seconds and on being shown again, goodbye when this view is removed.
  const view = Math.random().toString(36).slice(2);
  const say = (type) => {
    try {
      model.send({ type, view });
    } catch (error) {
      // The kernel has gone; there is nobody to tell, and the figures are stale.
      gone = true;
      redraw();
    }
  };
  say("hello");
  const pinging = setInterval(() => say("ping"), PING_MS);
  const onVisible = () => {
    if (document.visibilityState === "visible") say("ping");
  };
  document.addEventListener("visibilitychange", onVisible);
  // JupyterLab and Notebook 7 say when the kernel is dead (shut down, or gone
  // from the server): stale at once, not a silence of STALE_MS later. Other
  // front ends have no such kernel here, and rely on the silence alone.
  const kernel = model.widget_manager && model.widget_manager.kernel;
  const onStatus = (_, status) => {
    if (status === "dead") {
      gone = true;
      redraw();
    }
  };
  if (kernel && kernel.statusChanged) kernel.statusChanged.connect(onStatus);
  // Waiting and running clocks move between pushes.
  const ticking = setInterval(redraw, 1000);
  draw();
  return () => {
    clearInterval(pinging);
    clearInterval(ticking);
    document.removeEventListener("visibilitychange", onVisible);
    if (kernel && kernel.statusChanged) kernel.statusChanged.disconnect(onStatus);
    stop();
    say("gone");
  };
}

export default {
  initialize({ model }) {
    if (model.get("kind") === "monitor") keepHistory(model);
    else keepPoints(model);
  },
  render({ model, el }) {
    return model.get("kind") === "monitor" ? renderMonitor(model, el) : renderClaim(model, el);
  },
};
