/**
 * One poll of the server's snapshot, shared by the status bar and the panel.
 *
 * While claims run, their readings change every half second, so the poll
 * runs every second. With nothing claimed, it slows down to once every
 * five seconds (a claim shorter than that may pass unseen, which costs
 * nothing), and the first claim it sees brings it back to one second. It
 * stops while the browser tab is hidden. When the server fails, the Poll's
 * own backoff spaces out the retries.
 */
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { Snapshot, fetchSnapshot } from './api';

const BUSY_MS = 1000;
const IDLE_FIRST_MS = 2000;
const IDLE_MAX_MS = 5000;

export class MachineModel {
  constructor() {
    this._poll = new Poll({
      factory: () => this._fetch(),
      frequency: { interval: BUSY_MS, backoff: true, max: 30000 },
      standby: 'when-hidden',
      name: 'fluksio-nb:snapshot'
    });
  }

  /** The latest snapshot, or null before the first answer. */
  snapshot: Snapshot | null = null;
  /** What went wrong with the last poll, or null when it worked. */
  error: string | null = null;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Poll now, for a user who just acted and expects to see the result. */
  refresh(): Promise<void> {
    return this._poll.refresh();
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
    this.snapshot = snapshot;
    this.error = null;
    this._changed.emit();
  }

  private _poll: Poll;
  private _idleRounds = 0;
  private _changed = new Signal<this, void>(this);
}
