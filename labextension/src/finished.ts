/**
 * The claims that ended lately, in the panel: how each ended, how long it
 * waited and ran, and the most memory it held.
 *
 * Without this, a claim vanished from the panel the moment it ended, and
 * whether it ended well could only be read in its notebook. The server keeps
 * the last twenty, everyone's; this shows them as it sends them, newest
 * first. A figure nobody measured is left out rather than shown as zero:
 * a claim cancelled in the queue never ran and held nothing. A failed claim
 * carries its error line, which the server reads from the user's own records
 * only. Words, figures and marks are those of every other view (format.ts,
 * fluksio_nb/vocabulary.py): the server sends the times, not timestamps to
 * subtract, and each ending's mark.
 */
import { FinishedClaim } from './api';
import { clock, human, shareWords, timesWords } from './format';

/** For servers that send no mark: an ending's mark (never colour alone: the word is there). */
const MARKS: Record<string, 'good' | 'bad' | 'stopped'> = {
  ok: 'good',
  error: 'bad',
  died: 'bad',
  'kernel died': 'bad',
  'timed out': 'bad',
  halted: 'bad',
  interrupted: 'stopped',
  cancelled: 'stopped',
  'time limit': 'stopped',
  'idle cards': 'stopped'
};

/** `waited 12 s · ran 2 min 5 s · ended 14:03:12`. */
export function describeTimes(claim: FinishedClaim): string {
  const times = timesWords(claim.waited_s, claim.ran_s);
  // Held together: a narrow panel must not leave the clock alone on the next line.
  const ended = `ended ${clock(claim.ended_at)}`.replace(/ /g, '\u00a0');
  return [...times, ended].join(' · ');
}

/** `peak RSS 1.2GB · peak GPU 2.0GB`, or '' where neither was measured. */
export function describePeaks(claim: FinishedClaim): string {
  const parts = [];
  if (claim.peak_rss_bytes !== null) {
    parts.push(`peak RSS ${human(claim.peak_rss_bytes)}`);
  }
  if (claim.peak_gpu_bytes !== null) {
    parts.push(`peak GPU ${human(claim.peak_gpu_bytes)}`);
  }
  return parts.join(' · ');
}

export class FinishedView {
  constructor(parent: HTMLElement) {
    this._heading = document.createElement('h3');
    this._heading.className = 'fluksio-lab-heading';
    parent.appendChild(this._heading);
    this._message = document.createElement('div');
    this._message.className = 'fluksio-lab-note';
    parent.appendChild(this._message);
    this._list = document.createElement('ul');
    this._list.className = 'fluksio-lab-list fluksio-lab-list-finished';
    parent.appendChild(this._list);
    this.show(null, null);
  }

  show(claims: FinishedClaim[] | null, error: string | null): void {
    this._heading.textContent = claims === null ? 'Finished' : `Finished (${claims.length})`;
    this._heading.title = 'The last claims to end on this machine, anyone’s, newest first';
    this._message.textContent = error ?? (claims?.length === 0 ? 'No claim has ended yet.' : '');
    this._message.hidden = !this._message.textContent;
    // Rebuilt only when the list changes: an ended claim's record does not.
    const key = (claims ?? []).map(claim => `${claim.asked_at}:${claim.label}`).join(',');
    if (key === this._key) {
      return;
    }
    this._key = key;
    this._list.replaceChildren(...(claims ?? []).map(row));
  }

  private _heading: HTMLElement;
  private _message: HTMLElement;
  private _list: HTMLElement;
  private _key = '';
}

function line(className: string, text: string, parent: HTMLElement): HTMLElement {
  const node = document.createElement('div');
  node.className = className;
  node.textContent = text;
  parent.appendChild(node);
  return node;
}

/** One finished claim; everything a user wrote is set as text. */
function row(claim: FinishedClaim): HTMLElement {
  const node = document.createElement('li');
  node.className = 'fluksio-lab-claim fluksio-lab-finished';
  node.dataset.mark = claim.mark ?? MARKS[claim.ending] ?? 'bad';
  const head = document.createElement('div');
  head.className = 'fluksio-lab-claim-head';
  node.appendChild(head);
  line('fluksio-lab-claim-label', claim.label, head);
  const ending = line('fluksio-lab-ending', claim.ending, head);
  ending.dataset.ending = claim.ending;
  // The record keeps the notebook's full path; its name is what a person knows it by.
  const where = claim.notebook ? claim.notebook.split('/').pop() : 'no notebook';
  const who = line('fluksio-lab-claim-where', `${claim.user} · ${where}`, node);
  who.title = claim.notebook ?? 'The claim was not made from a notebook';
  line('fluksio-lab-claim-share', describeTimes(claim), node);
  if (claim.ran_s !== null && claim.cpus) {
    line('fluksio-lab-claim-held', shareWords({ ...claim, cpus: claim.cpus }), node);
  }
  if (claim.error) {
    // The user's own claim's error line, as text: a cell's error may say anything.
    line('fluksio-lab-claim-error', claim.error, node).dataset.field = 'error';
  }
  const peaks = describePeaks(claim);
  if (peaks) {
    line('fluksio-lab-claim-readings', peaks, node);
  }
  return node;
}
