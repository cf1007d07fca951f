/**
 * One poll of the server, shared by the status bar, the panel and the notices.
 *
 * While claims run, their readings change every half second, so the poll
 * runs every second. With nothing claimed, it slows down to once every
 * five seconds (a claim shorter than that may pass unseen, which costs
 * nothing), and the first claim it sees brings it back to one second. When
 * the server fails, the Poll's own backoff spaces out the retries.
 *
 * It stops while the browser tab is hidden, unless this user has a claim
 * running or waiting: then it goes on, because that claim starting or ending
 * is what the notices tell a user who is looking elsewhere.
 *
 * The machine's history and the finished claims are read only while someone
 * looks at them (the panel is shown), at most every few seconds: the history
 * moves by one point per interval, and claims end far less often than that.
 */
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import {
  ApiError,
  FinishedClaim,
  History,
  Snapshot,
  fetchFinished,
  fetchHistory,
  fetchSnapshot
} from './api';

const BUSY_MS = 1000;
const IDLE_FIRST_MS = 2000;
const IDLE_MAX_MS = 5000;
const DETAIL_EVERY_MS = 2000;

export class MachineModel {
  constructor() {
    this._poll = new Poll({
      factory: () => this._fetch(),
      frequency: { interval: BUSY_MS, backoff: true, max: 30000 },
      standby: () => document.hidden && !this._mineActive(),
      name: 'fluksio-nb:snapshot'
    });
  }

  /** The latest snapshot, or null before the first answer. */
  snapshot: Snapshot | null = null;
  /** What went wrong with the last poll, or null when it worked. */
  error: string | null = null;
  /** The machine's last minutes, or null before the first answer or when it failed. */
  history: History | null = null;
  /** Why there is no history, in words; null when there is. */
  historyError: string | null = null;
  /** The last claims to end, newest first; null before the first answer or when it failed. */
  finished: FinishedClaim[] | null = null;
  finishedError: string | null = null;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Whether the history and the finished claims are wanted: the panel is on show. */
  get watched(): boolean {
    return this._watched;
  }

  set watched(watched: boolean) {
    if (watched === this._watched) {
      return;
    }
    this._watched = watched;
    if (watched) {
      this._detailAt = 0;
      void this.refresh();
    }
  }

  /** Poll now, for a user who just acted and expects to see the result. */
  refresh(): Promise<void> {
    return this._poll.refresh();
  }

  /** The finished claims, read now: a notice about a claim that just ended says how. */
  async readFinished(): Promise<FinishedClaim[] | null> {
    try {
      this.finished = await fetchFinished();
      this.finishedError = null;
    } catch (reason) {
      this.finished = null;
      this.finishedError = missing('finished claims', reason);
    }
    return this.finished;
  }

  private _mineActive(): boolean {
    const snapshot = this.snapshot;
    return (
      snapshot !== null &&
      [...snapshot.running, ...snapshot.waiting].some(claim => claim.mine)
    );
  }

  private async _fetch(): Promise<void> {
    let snapshot: Snapshot;
    try {
      snapshot = await fetchSnapshot();
    } catch (reason) {
      this.error = reason instanceof Error ? reason.message : String(reason);
      this._changed.emit();
      throw reason; // a rejected tick is what makes the Poll back off
    }
    const busy = snapshot.running.length + snapshot.waiting.length > 0;
    this._idleRounds = busy ? 0 : this._idleRounds + 1;
    const interval = busy
      ? BUSY_MS
      : Math.min(IDLE_FIRST_MS * 2 ** (this._idleRounds - 1), IDLE_MAX_MS);
    if (interval !== this._poll.frequency.interval) {
      this._poll.frequency = { ...this._poll.frequency, interval };
    }
    const ended = this._claimsEnded(snapshot);
    this.snapshot = snapshot;
    this.error = null;
    if (this._watched && (ended || Date.now() - this._detailAt >= DETAIL_EVERY_MS)) {
      this._detailAt = Date.now();
      await Promise.all([this._readHistory(), this.readFinished()]);
    }
    this._changed.emit();
  }

  /** Whether a claim the last snapshot had is gone from this one: it has ended. */
  private _claimsEnded(snapshot: Snapshot): boolean {
    const now = new Set([...snapshot.running, ...snapshot.waiting].map(claim => claim.ticket));
    const before = this.snapshot;
    return (
      before !== null &&
      [...before.running, ...before.waiting].some(claim => !now.has(claim.ticket))
    );
  }

  private async _readHistory(): Promise<void> {
    try {
      this.history = await fetchHistory();
      this.historyError = null;
    } catch (reason) {
      this.history = null;
      this.historyError = missing("the machine's history", reason);
    }
  }

  private _poll: Poll;
  private _idleRounds = 0;
  private _watched = false;
  private _detailAt = 0;
  private _changed = new Signal<this, void>(this);
}

/** Why `what` could not be read, in words a user can act on. */
function missing(what: string, reason: unknown): string {
  if (reason instanceof ApiError && reason.status === 404) {
    return (
      `This server cannot show ${what}: its fluksio_nb is older than this panel. ` +
      'Upgrade fluksio_nb where the server runs, and restart it.'
    );
  }
  return `Could not read ${what}: ${reason instanceof Error ? reason.message : String(reason)}`;
}
