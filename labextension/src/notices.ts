/**
 * Telling a user that their queued cell has started, or that a long one has
 * ended, while they look elsewhere.
 *
 * A cell queued behind someone else's claim may wait minutes; a user who
 * moved to another tab or notebook has no way to know when it starts.
 * This watches the shared poll for this user's own claims (`mine`) and
 * says, through JupyterLab's notifications (which Notebook 7 shows too):
 * - when a claim that waited longer than `startedAfterWaitingSeconds` starts;
 * - when a claim ends, and how (`‘fit’ in a.ipynb failed after running
 *   31 s: ValueError: the model diverged.`), in format.ts's words and with
 *   the error line the server's finished claims carry: always when its
 *   notebook is not the one in front (a `--background` cell the person
 *   left, whatever its length), and otherwise when it ran longer than
 *   `endedAfterRunningSeconds`;
 * - when the OS stopped one of this server's kernels at the admin's
 *   `kernel_ram`, once for each stop, whatever the settings, and staying
 *   until closed: Jupyter itself says only that the kernel died, and the
 *   person needs to know why and how to claim more (its `why`). A stop
 *   older than a page load by `STOPS_SHOWN_AFTER_S` is not told again;
 * - when the machine's books warn of a running claim (its time limit near,
 *   as the admin set it), once for each warning, whatever the settings: it
 *   is about to be stopped, and the user may want to save what it did.
 * When the browser tab is hidden, a browser notification says the same,
 * since a toast in a hidden tab is seen only on coming back. The browser's
 * permission is asked once, when one of the user's claims first waits (that
 * is when a notice may become due), never on page load.
 *
 * A claim waited from its `since` (when it was asked for) until it was
 * first seen running; it ran until it was first seen gone. The poll runs
 * every second while claims exist, far finer than the thresholds. A claim
 * first seen already running (the page was opened late) gets no notice that
 * it started, and its run is counted from when it was first seen. A claim
 * that started and ended between two polls is never seen running: its
 * record among the finished claims says how it ended, and one notice says
 * that. A claim shorter than a poll may never be in a snapshot at all: the
 * finished claims (the user's own) are read every few seconds too, and one
 * that ended since the page was opened, never seen and not in front, is
 * told as well. A "started" notice is never said of a claim already seen to end,
 * nor after its end was told: the end is the news by then.
 */
import { Notification } from '@jupyterlab/apputils';

import { FinishedClaim, KernelStop, RunningClaim, WaitingClaim } from './api';
import { duration, endedWords } from './format';
import { MachineModel } from './model';

/** The extension's settings that concern notices; see schema/plugin.json. */
export interface NoticeSettings {
  notifyWhenStarted: boolean;
  startedAfterWaitingSeconds: number;
  notifyWhenEnded: boolean;
  endedAfterRunningSeconds: number;
  browserNotifications: boolean;
}

export const DEFAULT_NOTICES: NoticeSettings = {
  notifyWhenStarted: true,
  startedAfterWaitingSeconds: 10,
  notifyWhenEnded: true,
  endedAfterRunningSeconds: 30,
  browserNotifications: true
};

/** What is remembered of one of this user's claims between polls. */
interface Seen {
  label: string;
  /** When it was asked for (the server's `since`): with the label, it finds the record. */
  since: number;
  notebook: string | null;
  path: string | null;
  /** Browser time it was first seen running; null while it waits. */
  startedAt: number | null;
  /** The books' last warning told of it, '' before any. */
  warned: string;
}

/** How many times the finished claims are read for one that just ended. */
const RECORD_READS = 5;

/** On a page's first look, a kernel stopped longer ago than this is not told of again. */
const STOPS_SHOWN_AFTER_S = 600;

const ENDINGS_THAT_WENT_WRONG = new Set(['error', 'died', 'kernel died', 'timed out', 'halted']);

export class Notices {
  constructor(
    private _model: MachineModel,
    private _openNotebook: (path: string) => void,
    /** The path of the notebook the person has in front of them now, or null. */
    private _frontPath: () => string | null = () => null
  ) {
    _model.changed.connect(() => this._look());
  }

  settings: NoticeSettings = { ...DEFAULT_NOTICES };

  private _look(): void {
    const snapshot = this._model.snapshot;
    if (snapshot === null || this._model.error !== null) {
      return; // a failed poll says nothing about what ended
    }
    const now = Date.now() / 1000;
    const first = this._seen === null;
    const seen = this._seen ?? new Map<number, Seen>();
    const still = new Map<number, Seen>();
    for (const claim of snapshot.waiting.filter(claim => claim.mine)) {
      still.set(claim.ticket, seen.get(claim.ticket) ?? this._new(claim, null));
      this._askPermission();
    }
    for (const claim of snapshot.running.filter(claim => claim.mine)) {
      const before = seen.get(claim.ticket);
      if (before !== undefined && before.startedAt === null) {
        before.startedAt = now;
        this._started(claim, now - claim.since, before);
      }
      // A claim first seen running (or on the first look) is timed from now.
      const kept = before ?? this._new(claim, now);
      still.set(claim.ticket, kept);
      if (claim.warning && claim.warning !== kept.warned) {
        kept.warned = claim.warning;
        this._warned(claim.ticket, claim.warning, kept);
      }
    }
    if (!first) {
      for (const [ticket, claim] of seen) {
        if (still.has(ticket)) {
          continue;
        }
        if (claim.startedAt !== null) {
          void this._ended(ticket, claim, now - claim.startedAt);
        } else {
          void this._startedAndEndedUnseen(ticket, claim);
        }
      }
    }
    this._seen = still;
    for (const claim of [...snapshot.waiting, ...snapshot.running].filter(claim => claim.mine)) {
      // A claim is in every poll while it waits or runs: kept once, by when it was asked.
      const label = claim.label ?? 'a claim';
      const asked = this._everSeen.get(label) ?? new Set<number>();
      this._everSeen.set(label, asked.add(claim.since));
    }
    void this._endedUnseen();
    this._stopped(snapshot.kernel_stops ?? [], first ? now - STOPS_SHOWN_AFTER_S : 0);
  }

  private _stopped(stops: KernelStop[], after: number): void {
    for (const stop of stops) {
      const key = `${stop.kernel_id}@${stop.at}`;
      if (this._stopsTold.has(key) || stop.at < after) {
        continue;
      }
      this._stopsTold.add(key);
      const path = stop.path;
      Notification.emit(`${path ?? 'A kernel'}: ${stop.why}`, 'error', {
        autoClose: false,
        actions: path
          ? [{ label: 'Open the notebook', callback: () => this._openNotebook(path) }]
          : []
      });
    }
  }

  private _new(claim: RunningClaim | WaitingClaim, startedAt: number | null): Seen {
    return {
      label: claim.label ?? 'a claim',
      since: claim.since,
      notebook: claim.notebook,
      path: claim.path,
      startedAt,
      warned: ''
    };
  }

  private _warned(ticket: number, warning: string, seen: Seen): void {
    const message = `${quoted(seen.label)}${where(seen)}: ${warning}.`;
    this._say(message, 'warning', seen, `fluksio-warned-${ticket}`);
  }

  private _started(claim: RunningClaim, waited: number, seen: Seen): void {
    const { notifyWhenStarted, startedAfterWaitingSeconds } = this.settings;
    const told = this._endTold.has(claim.ticket);
    if (!notifyWhenStarted || waited <= startedAfterWaitingSeconds || told) {
      return;
    }
    const message =
      `${quoted(seen.label)} started after waiting ${duration(waited)}` + where(seen) + '.';
    this._say(message, 'info', seen, `fluksio-started-${claim.ticket}`);
  }

  /** A claim that started and ended between two polls: its end is told, once, never its start. */
  private async _startedAndEndedUnseen(ticket: number, seen: Seen): Promise<void> {
    const { notifyWhenStarted, startedAfterWaitingSeconds } = this.settings;
    this._endTold.add(ticket);
    const away = !this._inFront(seen.path);
    if (!(away && this.settings.notifyWhenEnded) && !notifyWhenStarted) {
      return;
    }
    const record = await this._record(ticket, seen);
    // Cancelled in the queue, or no record: it never started, and the user who cancelled knows.
    if (!record || record.started_at === null) {
      return;
    }
    if (!away && record.waited_s <= startedAfterWaitingSeconds) {
      return;
    }
    this._say(endedMessage(seen, record), kindOf(record), seen, `fluksio-ended-${ticket}`);
  }

  private async _ended(ticket: number, seen: Seen, ran: number): Promise<void> {
    const { notifyWhenEnded, endedAfterRunningSeconds } = this.settings;
    this._endTold.add(ticket);
    // Away from its notebook, the person hears of every end; in front of it, of long ones.
    const away = !this._inFront(seen.path);
    if (!notifyWhenEnded || (!away && ran <= endedAfterRunningSeconds)) {
      return;
    }
    // The server's record says how it ended; without one, the notice says only that it did.
    const record = await this._record(ticket, seen);
    const message = record
      ? endedMessage(seen, record)
      : `${quoted(seen.label)}${where(seen)} ended after running ${duration(ran)}.`;
    this._say(message, record ? kindOf(record) : 'info', seen, `fluksio-ended-${ticket}`);
  }

  /**
   * The user's claims that ended since the page was opened without ever being in a
   * snapshot (shorter than a poll): told, once, when their notebook is not in front.
   */
  private async _endedUnseen(): Promise<void> {
    const now = Date.now() / 1000;
    const soon = now - this._endsReadAt < ENDS_EVERY_S;
    if (!this.settings.notifyWhenEnded || this._readingEnds || soon) {
      return;
    }
    this._readingEnds = true;
    this._endsReadAt = now;
    try {
      const finished = (await this._model.readFinished()) ?? [];
      for (const record of finished) {
        const key = `${record.label}@${record.asked_at}`;
        const seen = [...(this._everSeen.get(record.label) ?? [])].some(
          since => Math.abs(since - record.asked_at) < 1
        );
        if (seen || record.ended_at < this._openedAt || this._unseenTold.has(key)) {
          continue;
        }
        this._unseenTold.add(key);
        // The record keeps the notebook's full path; the notice names it as the panel does.
        const name = record.notebook ? record.notebook.split('/').pop() ?? null : null;
        const front = !document.hidden && this._inFrontEndsWith(record.notebook);
        if (record.started_at === null || front) {
          continue;
        }
        const about: Seen = {
          label: record.label,
          since: record.asked_at,
          notebook: name,
          path: null,
          startedAt: null,
          warned: ''
        };
        this._say(endedMessage(about, record), kindOf(record), about, `fluksio-ended-${key}`);
      }
    } finally {
      this._readingEnds = false;
    }
  }

  /** Whether the notebook in front is the one at the absolute `path` a record keeps. */
  private _inFrontEndsWith(path: string | null): boolean {
    return path !== null && this._frontPath() !== null && path.endsWith(`/${this._frontPath()}`);
  }

  /**
   * The server's record of how the claim `ticket` ended, or undefined when it has none.
   *
   * A record is found by its label and the time it was asked for: ticket
   * numbers start again with new books, and older records have none. The
   * claim's kernel writes the record as the claim leaves the books, so the
   * first read may come a moment before it: a few more reads, a second
   * apart, before the notice goes out without it.
   */
  private async _record(ticket: number, seen: Seen): Promise<FinishedClaim | undefined> {
    const same = (claim: FinishedClaim) =>
      claim.label === seen.label &&
      Math.abs(claim.asked_at - seen.since) < 1 &&
      (claim.ticket === null || claim.ticket === undefined || claim.ticket === ticket);
    for (let attempt = 0; ; attempt++) {
      const finished = await this._model.readFinished();
      const record = finished?.find(same);
      if (record !== undefined || finished === null || attempt >= RECORD_READS - 1) {
        return record;
      }
      await new Promise(resolve => setTimeout(resolve, 1000));
    }
  }

  private _say(
    message: string,
    type: 'info' | 'success' | 'warning' | 'error',
    seen: Seen,
    tag: string
  ): void {
    const path = seen.path;
    Notification.emit(message, type, {
      autoClose: 10_000,
      actions: path
        ? [{ label: 'Open the notebook', callback: () => this._openNotebook(path) }]
        : []
    });
    if (
      this.settings.browserNotifications &&
      document.hidden &&
      'Notification' in window &&
      window.Notification.permission === 'granted'
    ) {
      const shown = new window.Notification('fluksio', { body: message, tag });
      shown.onclick = () => {
        window.focus();
        if (path) {
          this._openNotebook(path);
        }
        shown.close();
      };
    }
  }

  /** Ask the browser once, when a notice may become due: one of this user's claims waits. */
  private _askPermission(): void {
    if (
      this._asked ||
      !this.settings.browserNotifications ||
      !('Notification' in window) ||
      window.Notification.permission !== 'default'
    ) {
      return;
    }
    this._asked = true;
    void window.Notification.requestPermission();
  }

  /** Null until the first look: claims already there then were not seen to start. */
  private _seen: Map<number, Seen> | null = null;
  private _asked = false;
  private _stopsTold = new Set<string>();
  /** The claims whose end was seen: no "started" notice for them, ever. */
  private _endTold = new Set<number>();
  /**
   * Every claim of the user's any snapshot showed, by label, and when each was asked:
   * their ends are told by `_ended`.
   */
  private _everSeen = new Map<string, Set<number>>();
  /** The unseen claims whose end was told, by label and when asked. */
  private _unseenTold = new Set<string>();
  private _openedAt = Date.now() / 1000;
  private _endsReadAt = 0;
  private _readingEnds = false;

  /** Whether the notebook at `path` (relative to the server's root) is the one in front. */
  private _inFront(path: string | null): boolean {
    return !document.hidden && path !== null && this._frontPath() === path;
  }
}

/** How often the finished claims are read for ends no snapshot showed. */
const ENDS_EVERY_S = 3;

/** `‘fit’ in a.ipynb failed after running 31 s: ValueError: the model diverged.` */
export function endedMessage(
  seen: { label: string; path: string | null; notebook: string | null },
  record: FinishedClaim
): string {
  const how = endedWords(record.ending, record.ran_s, record.error ?? null);
  return `${quoted(seen.label)}${where(seen)} ${how}.`;
}

/** A notice's kind from how the claim ended: the toast's colour and icon say it too. */
function kindOf(record: FinishedClaim): 'success' | 'warning' | 'error' {
  if (record.ending === 'ok') {
    return 'success';
  }
  return ENDINGS_THAT_WENT_WRONG.has(record.ending) ? 'error' : 'warning';
}

function quoted(label: string): string {
  return `‘${label}’`;
}

function where(seen: { path: string | null; notebook: string | null }): string {
  const notebook = seen.path ?? seen.notebook;
  return notebook ? ` in ${notebook}` : '';
}

/** The settings as stored, with anything missing or of the wrong kind taken from the defaults. */
export function noticeSettings(
  stored: Partial<Record<keyof NoticeSettings, unknown>>
): NoticeSettings {
  const settings = { ...DEFAULT_NOTICES };
  for (const key of Object.keys(DEFAULT_NOTICES) as (keyof NoticeSettings)[]) {
    const value = stored[key];
    if (typeof value === typeof DEFAULT_NOTICES[key]) {
      (settings as any)[key] = value;
    }
  }
  return settings;
}
