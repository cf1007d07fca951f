/**
 * The machine's last ten minutes in the panel: CPU, memory and each card.
 *
 * Drawn by hand in SVG: a few paths and labels do not need a charting
 * library. Each chart has its scale written on it (0, half and 100 % for
 * CPU; 0, half and the total for memory) and a time axis from ten minutes
 * ago through five to now, now
 * being the server's latest reading, so a browser whose clock is off does
 * not shift the plot. Where readings stop for a while (the server was down)
 * the line breaks rather than drawing a straight line across what nobody
 * saw. Each series has one colour in every view, the same as the `%claims`
 * monitor's: CPU blue, memory green, a card purple, CPU outside claims
 * orange and dashed (classes, set in style/base.css for light and dark).
 */
import { CardPoint, History, HistoryPoint } from './api';
import { human } from './format';

const SVG = 'http://www.w3.org/2000/svg';
const WIDTH = 240;
const HEIGHT = 74;
/** Room on the left for the scale's labels, and below for the time axis. */
const LEFT = 42;
const TOP = 6;
const BOTTOM = 16;
const RIGHT = 4;

function svg<K extends keyof SVGElementTagNameMap>(
  tag: K,
  attributes: Record<string, string | number>,
  parent?: Element
): SVGElementTagNameMap[K] {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) {
    node.setAttribute(name, String(value));
  }
  parent?.appendChild(node);
  return node;
}

/** One line of a chart: what it reads off a point (null where the point does not say). */
interface Series {
  name: string;
  className: string;
  value: (point: HistoryPoint) => number | null;
}

/** One chart with its scale: values from 0 to `max`, labelled with `scaleText`. */
class Chart {
  constructor(parent: HTMLElement, kind: string) {
    this.node = document.createElement('figure');
    this.node.className = 'fluksio-lab-chart';
    this.node.dataset.chart = kind;
    this._caption = document.createElement('figcaption');
    this._caption.className = 'fluksio-lab-chart-caption';
    this.node.appendChild(this._caption);
    this._svg = svg('svg', {
      viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
      role: 'img',
      class: 'fluksio-lab-plot'
    });
    this.node.appendChild(this._svg);
    parent.appendChild(this.node);
  }

  readonly node: HTMLElement;

  show(
    history: History,
    series: Series[],
    max: number,
    scale: (value: number) => string,
    caption: string
  ): void {
    const plot = this._svg;
    plot.replaceChildren();
    const points = history.points;
    const now = points.length ? points[points.length - 1].at : 0;
    const span = history.span_s > 0 ? history.span_s : 600;
    const right = WIDTH - RIGHT;
    const bottom = HEIGHT - BOTTOM;
    const x = (at: number) => LEFT + ((at - (now - span)) / span) * (right - LEFT);
    const y = (value: number) =>
      bottom - (Math.min(Math.max(value, 0), max) / (max || 1)) * (bottom - TOP);

    // The frame and the scale: the top line is `max`, the bottom one 0.
    svg('line', { x1: LEFT, x2: right, y1: TOP, y2: TOP, class: 'fluksio-lab-grid' }, plot);
    svg('line', { x1: LEFT, x2: right, y1: bottom, y2: bottom, class: 'fluksio-lab-axis' }, plot);
    const label = (text: string, attributes: Record<string, string | number>) => {
      svg('text', { class: 'fluksio-lab-scale', ...attributes }, plot).textContent = text;
    };
    const middle = (TOP + bottom) / 2;
    svg('line', { x1: LEFT, x2: right, y1: middle, y2: middle, class: 'fluksio-lab-grid' }, plot);
    const halfway = (LEFT + right) / 2;
    svg('line', { x1: halfway, x2: halfway, y1: TOP, y2: bottom, class: 'fluksio-lab-grid' }, plot);
    label(scale(max), { x: LEFT - 4, y: TOP + 4, 'text-anchor': 'end' });
    label(scale(max / 2), { x: LEFT - 4, y: middle + 4, 'text-anchor': 'end' });
    label(scale(0), { x: LEFT - 4, y: bottom, 'text-anchor': 'end' });
    const minutes = Math.round(span / 60);
    label(`${minutes} min ago`, { x: LEFT, y: HEIGHT - 3 });
    label(`${minutes / 2} min ago`, { x: halfway, y: HEIGHT - 3, 'text-anchor': 'middle' });
    label('now', { x: right, y: HEIGHT - 3, 'text-anchor': 'end' });

    // A gap of more than three intervals is readings nobody took: the line breaks there.
    const gap = Math.max(history.interval_s * 3, 5);
    for (const line of series) {
      let d = '';
      let last: number | null = null;
      for (const point of points) {
        const value = line.value(point);
        if (value === null || point.at < now - span) {
          last = null;
          continue;
        }
        const move = last === null || point.at - last > gap ? 'M' : 'L';
        d += `${move}${x(point.at).toFixed(1)} ${y(value).toFixed(1)} `;
        last = point.at;
      }
      const path = svg('path', { d: d.trim(), class: `fluksio-lab-line ${line.className}` }, plot);
      path.dataset.series = line.name;
    }
    plot.dataset.points = String(points.length);
    plot.dataset.latest = String(now);
    plot.setAttribute('aria-label', caption);
    this._caption.textContent = caption;
  }

  private _caption: HTMLElement;
  private _svg: SVGSVGElement;
}

const CPU: Series[] = [
  { name: 'cpu', className: 'fluksio-lab-line-cpu', value: point => point.cpu_percent },
  {
    name: 'outside',
    className: 'fluksio-lab-line-outside',
    value: point => point.cpu_outside_claims_percent
  }
];

const MEMORY: Series[] = [
  {
    name: 'memory',
    className: 'fluksio-lab-line-memory',
    value: point => point.memory_used_bytes
  }
];

/** A memory scale's label: `0` at the bottom, as the `%claims` monitor writes it. */
function bytesScale(value: number): string {
  return value ? human(value) : '0';
}

function card(point: HistoryPoint, index: number): CardPoint | undefined {
  return point.cards.find(one => one.index === index);
}

/** The history section of the panel: a chart each for CPU and memory, and one per card. */
export class HistoryView {
  constructor(parent: HTMLElement) {
    this.node = document.createElement('section');
    this.node.className = 'fluksio-lab-history';
    const heading = document.createElement('h3');
    heading.className = 'fluksio-lab-heading';
    // The host as a whole, every process on it: not the shares above, which count claims.
    heading.textContent = 'The host, last 10 minutes';
    this.node.appendChild(heading);
    this._message = document.createElement('div');
    this._message.className = 'fluksio-lab-note';
    this.node.appendChild(this._message);
    this._cpu = new Chart(this.node, 'cpu');
    this._memory = new Chart(this.node, 'memory');
    this._cards = document.createElement('div');
    this.node.appendChild(this._cards);
    parent.appendChild(this.node);
  }

  readonly node: HTMLElement;

  show(history: History | null, error: string | null): void {
    const points = history?.points ?? [];
    this._message.textContent =
      error ?? (history === null ? 'Reading the machine’s history…' : '');
    if (history !== null && points.length === 0) {
      this._message.textContent = 'No readings yet: the server has only just started.';
    }
    this._message.hidden = !this._message.textContent;
    const shown = history !== null && points.length > 0;
    this._cpu.node.hidden = this._memory.node.hidden = this._cards.hidden = !shown;
    if (!shown) {
      return;
    }
    const latest = points[points.length - 1];
    const outside = latest.cpu_outside_claims_percent;
    this._cpu.show(
      history,
      CPU,
      100,
      value => `${Math.round(value)}%`,
      `Host CPU ${latest.cpu_percent.toFixed(0)}% used` +
        (outside === null ? '' : `, ${outside.toFixed(0)}% of it outside any claim (dashed)`)
    );
    const total = Math.max(...points.map(point => point.memory_total_bytes));
    this._memory.show(
      history,
      MEMORY,
      total,
      bytesScale,
      `Host memory ${human(latest.memory_used_bytes)}/${human(latest.memory_total_bytes)} used`
    );
    this._showCards(history, latest);
  }

  private _showCards(history: History, latest: HistoryPoint): void {
    const indices = [...new Set(history.points.flatMap(p => p.cards.map(c => c.index)))].sort(
      (a, b) => a - b
    );
    for (const [index, chart] of this._cardCharts) {
      if (!indices.includes(index)) {
        chart.node.remove();
        this._cardCharts.delete(index);
      }
    }
    for (const index of indices) {
      let chart = this._cardCharts.get(index);
      if (chart === undefined) {
        chart = new Chart(this._cards, `card-${index}`);
        this._cardCharts.set(index, chart);
      }
      const totals = history.points.map(p => card(p, index)?.total_bytes ?? 0);
      const total = Math.max(...totals);
      // A card that never said its size is scaled to the most it was seen to hold.
      const scale =
        total || Math.max(1, ...history.points.map(p => card(p, index)?.used_bytes ?? 0));
      const now = card(latest, index);
      const busy =
        now?.utilisation_percent === null || now?.utilisation_percent === undefined
          ? ''
          : `${now.utilisation_percent.toFixed(0)}% busy, `;
      const used =
        now?.used_bytes === null || now?.used_bytes === undefined
          ? 'memory not read'
          : `${human(now.used_bytes)}/${human(now.total_bytes ?? total)} used`;
      chart.show(
        history,
        [
          {
            name: 'card-memory',
            className: 'fluksio-lab-line-card',
            value: p => card(p, index)?.used_bytes ?? null
          }
        ],
        scale,
        bytesScale,
        `card ${index}: ${busy}${used}`
      );
    }
  }

  private _message: HTMLElement;
  private _cpu: Chart;
  private _memory: Chart;
  private _cards: HTMLElement;
  private _cardCharts = new Map<number, Chart>();
}
