/**
 * The status-bar item: how much of the machine is in use, at a glance.
 *
 * `cpus 6/14 used · gpus 1/2 used · 2 waiting`: used/total, as the panel and
 * `%claims` say it. Cards are left out on a machine without any, and the
 * queue when nobody waits. The queue is counted whole: other users' claims
 * the machine's books count but do not list are in it. Card memory held
 * with no claim on its card adds `1 squatter`; its hover says whose. The
 * hover also names the user's own claims, each with its notebook, and a
 * waiting one's place in the queue, and how many cores are kept back for
 * kernels, so a 2-core machine that hands out one says where the other is.
 */
import { Widget } from '@lumino/widgets';

import { MachineModel } from './model';
import { plural } from './format';
import { Snapshot, waitingCount } from './api';
import { describeWait } from './panel';
import { describeCores } from './cores';

export function describeUse(snapshot: Snapshot): string {
  const { cpus, gpus } = snapshot;
  const parts = [`cpus ${cpus.total - cpus.free}/${cpus.total} used`];
  if (gpus.total > 0) {
    parts.push(`gpus ${gpus.total - gpus.free}/${gpus.total} used`);
  }
  const waiting = waitingCount(snapshot);
  if (waiting > 0) {
    parts.push(`${waiting} waiting`);
  }
  const squatters = snapshot.squatters ?? [];
  if (squatters.length > 0) {
    parts.push(plural(squatters.length, 'squatter'));
  }
  return parts.join(' · ');
}

/** The cards and the squatters, one line each, for the item's hover. */
export function describeCards(snapshot: Snapshot): string {
  const lines = (snapshot.cards ?? []).map(card => card.text);
  for (const squatter of snapshot.squatters ?? []) {
    lines.push(squatter.text);
  }
  for (const claim of snapshot.running) {
    if (claim.mine && claim.gpu) {
      lines.push(`${claim.label}: ${claim.gpu.text}`);
    }
  }
  return lines.join('\n');
}

/** This user's claims, one line each: `fit (work/train.ipynb): 2nd in the queue · …`. */
export function describeMine(snapshot: Snapshot): string {
  const where = (claim: { notebook: string | null; path: string | null }) => {
    const notebook = claim.path ?? claim.notebook;
    return notebook ? ` (${notebook})` : '';
  };
  return [
    ...snapshot.running
      .filter(claim => claim.mine)
      .map(claim => `${claim.label}${where(claim)}: running`),
    ...snapshot.waiting
      .filter(claim => claim.mine)
      .map(claim => `${claim.label}${where(claim)}: ${describeWait(claim)}`)
  ].join('\n');
}

export class MachineStatus extends Widget {
  constructor(model: MachineModel, open: () => void) {
    super();
    this.addClass('fluksio-lab-status');
    this.node.tabIndex = 0;
    this.node.addEventListener('click', open);
    this.node.addEventListener('keydown', event => {
      if (event.key === 'Enter' || event.key === ' ') {
        open();
      }
    });
    model.changed.connect(() => this._show(model));
    this._show(model);
  }

  private _show(model: MachineModel): void {
    const snapshot = model.snapshot;
    if (model.error !== null) {
      this.node.textContent = 'fluksio: unavailable';
      this.node.title = model.error;
    } else if (snapshot === null) {
      this.node.textContent = 'fluksio: …';
      this.node.title = 'Reading the machine’s shares';
    } else {
      this.node.textContent = describeUse(snapshot);
      this.node.title =
        snapshot.ledger === null
          ? 'Every kernel keeps its own books (FLUKSIO_LEDGER=kernel): claims are not visible here'
          : `${plural(snapshot.running.length, 'claim')} running, ` +
            `${waitingCount(snapshot)} waiting. Click to see them.`;
      const mine = [describeCores(snapshot), describeMine(snapshot), describeCards(snapshot)];
      for (const more of mine) {
        if (more) {
          this.node.title += `\n${more}`;
        }
      }
    }
  }
}
