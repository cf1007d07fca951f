/**
 * The sidebar panel: the machine now and over the last ten minutes, every
 * kernel's running and waiting claims with a button to cancel your own, and
 * the claims that ended lately.
 *
 * Every figure reads as used/total (`cpus 1/4 used`), as in the status bar
 * and `%claims`. A waiting claim shows its place in the queue (`2nd in the
 * queue`) and when it may start; ticket numbers are ids and never shown.
 * On books every user shares, only the first of other users' waiting
 * claims are listed: the Waiting count is the whole queue's, and a line
 * below the list says how many more are not listed, as `fluksio-nb` does.
 *
 * Rows are kept by ticket and updated in place, not rebuilt on every poll.
 * A row rebuilt between a mouse-down and a mouse-up would swallow the click
 * on its cancel button. Everything a user wrote (labels, paths) is set as
 * text, never as HTML.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { Card, KernelStop, RunningClaim, Squatter, WaitingClaim, cancelClaim } from './api';
import { describeCores } from './cores';
import { FinishedView } from './finished';
import {
  askedWords,
  clock,
  human,
  ordinal,
  plural,
  roughly,
  shareWords,
  unlistedWords
} from './format';
import { HistoryView } from './history';
import { MachineModel } from './model';

export const machineIcon = new LabIcon({
  name: 'fluksio-nb:machine',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16">' +
    '<g class="jp-icon3" fill="#616161">' +
    '<path d="M7 7h10v10H7zM9 9v6h6V9zM9 2h2v3H9zm4 0h2v3h-2zM9 19h2v3H9zm4 0h2v3h-2z' +
    'M2 9h3v2H2zm0 4h3v2H2zm17-4h3v2h-3zm0 4h3v2h-3z"/></g></svg>'
});

function element<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className: string,
  parent?: HTMLElement
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = className;
  parent?.appendChild(node);
  return node;
}

/** One resource's bar: what is used out of what there is. */
class Bar {
  constructor(parent: HTMLElement, name: string) {
    const row = (this._row = element('div', 'fluksio-lab-bar', parent));
    element('span', 'fluksio-lab-bar-name', row).textContent = name;
    const track = element('div', 'fluksio-lab-bar-track', row);
    this._fill = element('div', 'fluksio-lab-bar-fill', track);
    this._text = element('span', 'fluksio-lab-bar-text', row);
  }

  show(used: number, total: number, text: string): void {
    // Nothing of it on the machine (no cards), nothing said of it: as in every view.
    this._row.hidden = total <= 0;
    const share = total > 0 ? Math.min(1, Math.max(0, used / total)) : 0;
    this._fill.style.width = `${(share * 100).toFixed(1)}%`;
    this._text.textContent = text;
  }

  private _row: HTMLElement;
  private _fill: HTMLElement;
  private _text: HTMLElement;
}

type AnyClaim = RunningClaim | WaitingClaim;

/** One claim's row; made once per ticket and updated in place. */
class ClaimRow {
  constructor(
    readonly state: 'running' | 'waiting',
    private _panel: MachinePanel
  ) {
    this.node = element('li', `fluksio-lab-claim fluksio-lab-${state}`);
    const head = element('div', 'fluksio-lab-claim-head', this.node);
    this._label = element('span', 'fluksio-lab-claim-label', head);
    this._button = element('button', 'jp-Button jp-mod-styled fluksio-lab-cancel', head);
    this._button.textContent = state === 'running' ? 'Stop' : 'Cancel';
    this._button.addEventListener('click', () => {
      if (this._claim !== null) {
        void this._panel.cancel(this._claim, this.state);
      }
    });
    this._where = element('a', 'fluksio-lab-claim-where', this.node);
    this._where.addEventListener('click', event => {
      event.preventDefault();
      if (this._claim?.path) {
        this._panel.openNotebook(this._claim.path);
      }
    });
    this._share = element('div', 'fluksio-lab-claim-share', this.node);
    this._readings = element('div', 'fluksio-lab-claim-readings', this.node);
    this._warning = element('div', 'fluksio-lab-claim-warning', this.node);
    this._warning.hidden = true;
  }

  readonly node: HTMLLIElement;

  show(claim: AnyClaim): void {
    this._claim = claim;
    this.node.dataset.ticket = String(claim.ticket);
    const label = labelOf(claim);
    this._label.textContent = label;
    this._button.hidden = !claim.can_cancel;
    this._button.title =
      this.state === 'running'
        ? `Stop ${label}: its worker is stopped and the share given back`
        : `Take ${label} out of the queue`;

    const where = claim.path ?? claim.notebook ?? `pid ${claim.pid}`;
    this._where.textContent = claim.mine ? where : `${claim.user ?? 'another user'} · ${where}`;
    this._where.title = claim.path
      ? `Open ${claim.path}`
      : claim.notebook ?? `A kernel this server did not start (pid ${claim.pid})`;
    this._where.classList.toggle('fluksio-lab-openable', claim.path !== null);

    if (this.state === 'running') {
      const { allocation, readings, gpu } = claim as RunningClaim;
      // Spelled as the claim line, the cell's record and %claims spell a share.
      this._share.textContent = shareWords(allocation);
      // Card figures only where the cards were read: unknown is not zero.
      const cardsSaid = gpu ? ` · ${gpu.text}` : '';
      const stopped = readings?.stopped_since;
      this._readings.textContent =
        (stopped ? `stopped by a signal since ${clock(stopped)} · ` : '') +
        (readings
          ? `RSS ${human(readings.rss_bytes)} · CPU ${readings.cpu_percent.toFixed(0)}%${cardsSaid}`
          : `no readings yet${cardsSaid}`);
      this.node.classList.toggle('fluksio-lab-stopped', !!stopped);
      // The books' own words, its time limit near: every user sees it coming.
      const warning = (claim as RunningClaim).warning ?? '';
      this._warning.textContent = warning;
      this._warning.hidden = !warning;
      this.node.classList.toggle('fluksio-lab-warned', !!warning);
      this._readings.title = readings
        ? `peak RSS ${human(readings.peak_rss_bytes)}; CPU is the share of the whole ` +
          `machine, ${plural(readings.processes, 'process', 'processes')}`
        : '';
    } else {
      const waiting = claim as WaitingClaim;
      const { asked } = waiting;
      this._share.textContent = `asks ${askedWords(asked)}`;
      this._readings.textContent = describeWait(waiting);
      // What the guess rests on, for whoever wonders; the row itself says only the guess.
      const why = waiting.expected_wait?.why;
      this._readings.title = `asked at ${clock(claim.since)}` + (why ? `; ${why}` : '');
    }
  }

  setBusy(busy: boolean): void {
    this._button.disabled = busy;
  }

  private _claim: AnyClaim | null = null;
  private _label: HTMLElement;
  private _button: HTMLButtonElement;
  private _where: HTMLAnchorElement;
  private _share: HTMLElement;
  private _readings: HTMLElement;
  private _warning: HTMLElement;
}

/** A list of claims in one state, kept in the server's order. */
class ClaimList {
  constructor(
    parent: HTMLElement,
    title: string,
    private _state: 'running' | 'waiting',
    private _panel: MachinePanel
  ) {
    this._heading = element('h3', 'fluksio-lab-heading', parent);
    this._title = title;
    this._list = element('ul', `fluksio-lab-list fluksio-lab-list-${_state}`, parent);
    this._unlisted = element('div', 'fluksio-lab-note fluksio-lab-unlisted', parent);
    this._unlisted.hidden = true;
  }

  /** `unlisted`: how many more claims there are than the books listed in `claims`. */
  show(claims: AnyClaim[], unlisted = 0): void {
    this._heading.textContent = `${this._title} (${claims.length + unlisted})`;
    this._unlisted.textContent = unlisted ? unlistedWords(unlisted) : '';
    this._unlisted.hidden = !unlisted;
    const seen = new Set<number>();
    claims.forEach((claim, index) => {
      seen.add(claim.ticket);
      let row = this._rows.get(claim.ticket);
      if (row === undefined) {
        row = new ClaimRow(this._state, this._panel);
        this._rows.set(claim.ticket, row);
      }
      row.show(claim);
      if (this._list.children[index] !== row.node) {
        this._list.insertBefore(row.node, this._list.children[index] ?? null);
      }
    });
    for (const [ticket, row] of this._rows) {
      if (!seen.has(ticket)) {
        row.node.remove();
        this._rows.delete(ticket);
      }
    }
  }

  row(ticket: number): ClaimRow | undefined {
    return this._rows.get(ticket);
  }

  private _heading: HTMLElement;
  private _title: string;
  private _list: HTMLElement;
  private _unlisted: HTMLElement;
  private _rows = new Map<number, ClaimRow>();
}

export class MachinePanel extends Widget {
  constructor(
    private _model: MachineModel,
    readonly openNotebook: (path: string) => void
  ) {
    super();
    this.id = 'fluksio-nb-panel';
    this.addClass('fluksio-lab-panel');
    this.title.icon = machineIcon;
    this.title.caption = 'Machine shares';
    const body = this.node;
    element('h2', 'fluksio-lab-title', body).textContent = 'Machine shares';
    this._message = element('div', 'fluksio-lab-message', body);
    // One grid for the three bars, so their tracks start and end together
    // whatever each one's figures say; named as the claim line and every
    // other view name them.
    const bars = element('div', 'fluksio-lab-bars', body);
    this._cpus = new Bar(bars, 'cpus');
    this._gpus = new Bar(bars, 'gpus');
    this._ram = new Bar(bars, 'ram');
    this._keptBack = element('div', 'fluksio-lab-kept-back', body);
    this._enforcement = element('div', 'fluksio-lab-enforcement', body);
    this._cards = element('ul', 'fluksio-lab-cards', body);
    this._squatters = element('div', 'fluksio-lab-squatters', body);
    this._stops = element('div', 'fluksio-lab-kernel-stops', body);
    this._running = new ClaimList(body, 'Running', 'running', this);
    this._waiting = new ClaimList(body, 'Waiting', 'waiting', this);
    this._history = new HistoryView(body);
    this._finished = new FinishedView(body);
    _model.changed.connect(() => this._show());
    this._show();
  }

  protected onAfterShow(): void {
    this._model.watched = true;
  }

  protected onAfterAttach(): void {
    this._model.watched = this.isVisible;
  }

  protected onAfterHide(): void {
    this._model.watched = false;
  }

  protected onBeforeDetach(): void {
    this._model.watched = false;
  }

  async cancel(claim: AnyClaim, state: 'running' | 'waiting'): Promise<void> {
    if (state === 'running') {
      const answer = await showDialog({
        title: `Stop ${labelOf(claim)}?`,
        body: 'Its worker is stopped and its share given back. The cell ends with an error.',
        buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
      });
      if (!answer.button.accept) {
        return;
      }
    }
    const list = state === 'running' ? this._running : this._waiting;
    list.row(claim.ticket)?.setBusy(true);
    try {
      await cancelClaim(claim.ticket);
      this._actionError = null;
    } catch (reason) {
      this._actionError = reason instanceof Error ? reason.message : String(reason);
      list.row(claim.ticket)?.setBusy(false);
    }
    this._show();
    await this._model.refresh();
  }

  private _show(): void {
    const { snapshot, error } = this._model;
    const problem = this._actionError ?? error;
    this._message.textContent = problem ?? '';
    this._message.hidden = problem === null;
    if (snapshot === null) {
      return;
    }
    const { cpus, gpus, ram_bytes: ram } = snapshot;
    const cpusUsed = cpus.total - cpus.free;
    this._cpus.show(cpusUsed, cpus.total, `${cpusUsed}/${cpus.total} used`);
    this._keptBack.textContent = describeCores(snapshot);
    this._keptBack.hidden = !this._keptBack.textContent;
    const held = gpus.total - gpus.free;
    // Each card shared by slices, as every view says it: "card 0: 3 claims, 60/80 GB".
    const sliced = (gpus.cards ?? [])
      .filter(card => card.claims && !card.whole)
      .map(card => {
        const gb = (n: number) => (n / 1e9).toFixed(0);
        const noun = card.claims === 1 ? 'claim' : 'claims';
        return `card ${card.index}: ${card.claims} ${noun}, ${gb(card.held_bytes)}/${gb(card.total_bytes)} GB`;
      });
    this._gpus.show(
      held,
      gpus.total,
      `${held}/${gpus.total} used` + (sliced.length ? ` · ${sliced.join(' · ')}` : '')
    );
    this._ram.show(
      ram.total - ram.free,
      ram.total,
      `${human(ram.total - ram.free)}/${human(ram.total)} used`
    );
    this._enforcement.replaceChildren();
    Object.entries(snapshot.enforcement ?? {}).forEach(([name, how], index) => {
      const part = element('span', 'fluksio-lab-held', this._enforcement);
      part.textContent = `${index ? ' · ' : 'held by '}${name}: ${how.label}`;
      part.dataset.by = how.by;
      part.title = how.why;
    });
    if (snapshot.ledger === null) {
      this._message.hidden = false;
      this._message.textContent =
        'Every kernel keeps its own books (FLUKSIO_LEDGER=kernel), so no claims can be shown here.';
    }
    this._running.show(snapshot.running);
    this._waiting.show(snapshot.waiting, snapshot.waiting_unlisted ?? 0);
    this._showCards(snapshot.cards ?? [], snapshot.squatters ?? []);
    this._showStops(snapshot.kernel_stops ?? []);
    this._history.show(this._model.history, this._model.historyError);
    this._finished.show(this._model.finished, this._model.finishedError);
  }

  /** Each card's utilisation and memory, and card memory held with no claim. */
  private _showCards(cards: Card[], squatters: Squatter[]): void {
    this._cards.replaceChildren(
      ...cards.map(card => {
        const line = element('li', 'fluksio-lab-card');
        line.dataset.card = String(card.index);
        line.textContent = card.text;
        return line;
      })
    );
    this._cards.hidden = cards.length === 0;
    this._squatters.replaceChildren();
    this._squatters.hidden = squatters.length === 0;
    if (squatters.length) {
      element('h3', 'fluksio-lab-heading', this._squatters).textContent =
        `Card memory with no claim (${squatters.length})`;
      const list = element('ul', 'fluksio-lab-list', this._squatters);
      for (const squatter of squatters) {
        const line = element('li', 'fluksio-lab-squatter', list);
        line.dataset.card = String(squatter.card);
        line.textContent = squatter.text;
      }
    }
  }

  /** Kernels the OS stopped at the admin's kernel_ram: which notebook, and why. */
  private _showStops(stops: KernelStop[]): void {
    this._stops.replaceChildren();
    this._stops.hidden = stops.length === 0;
    if (stops.length) {
      element('h3', 'fluksio-lab-heading', this._stops).textContent =
        `Kernels stopped at their memory cap (${stops.length})`;
      const list = element('ul', 'fluksio-lab-list', this._stops);
      for (const stop of stops) {
        const line = element('li', 'fluksio-lab-kernel-stop', list);
        line.dataset.kernel = stop.kernel_id;
        const when = new Date(stop.at * 1000).toLocaleTimeString();
        line.textContent = `${stop.path ?? 'a kernel'} at ${when}: ${stop.why}`;
      }
    }
  }

  private _message: HTMLElement;
  private _actionError: string | null = null;
  private _keptBack: HTMLElement;
  private _cpus: Bar;
  private _gpus: Bar;
  private _ram: Bar;
  private _enforcement: HTMLElement;
  private _cards: HTMLElement;
  private _squatters: HTMLElement;
  private _stops: HTMLElement;
  private _running: ClaimList;
  private _waiting: ClaimList;
  private _history: HistoryView;
  private _finished: FinishedView;
}

/** `2nd in the queue · starts in about 2 min`, or the server's words when it cannot tell. */
export function describeWait(claim: WaitingClaim): string {
  const place = `${ordinal(claim.position)} in the queue`;
  const expected = claim.expected_wait;
  if (expected === undefined) {
    return place;
  }
  if (expected.seconds === null) {
    return `${place} · ${expected.why}`;
  }
  return `${place} · starts in ${roughly(expected.seconds)}`;
}

/** A claim's label, or whose it is where its owner keeps labels private. */
function labelOf(claim: AnyClaim): string {
  return claim.label ?? `a claim of ${claim.user ?? 'another user'}`;
}
