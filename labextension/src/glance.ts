/**
 * The status-bar item beside the shares: what users of jupyter-resource-usage
 * look for there.
 *
 * `Kernel 312.0MB · Host CPU 23% · RAM 5.1GB/16.0GB`: the resident memory
 * of the kernel of the notebook in front (its own, as `%claims` says it, not
 * its claims' workers), and the host's CPU and memory in use, every process
 * on it. The shares item beside it says what is claimed; this one what is
 * used. Both come from the one poll (the server reads the host on its own
 * timer), so this item costs nothing more. No notebook in front, no kernel
 * figure; no reading yet, nothing at all.
 */
import { Widget } from '@lumino/widgets';

import { Snapshot } from './api';
import { describeCores } from './cores';
import { human } from './format';
import { MachineModel } from './model';

/** Which kernel the page is showing, if any: its memory is the one the item says. */
export type CurrentKernel = () => string | null;

/** The host now: `Host CPU 23% · RAM 5.1GB/16.0GB`; empty before the server's first reading. */
export function describeHost(snapshot: Snapshot): string {
  const host = snapshot.host;
  if (!host) {
    return '';
  }
  return (
    `Host CPU ${host.cpu_percent.toFixed(0)}% · ` +
    `RAM ${human(host.memory_used_bytes)}/${human(host.memory_total_bytes)}`
  );
}

export class UseStatus extends Widget {
  constructor(
    private _model: MachineModel,
    open: () => void,
    private _currentKernel: CurrentKernel
  ) {
    super();
    this.addClass('fluksio-lab-glance');
    this.node.tabIndex = 0;
    this.node.addEventListener('click', open);
    this.node.addEventListener('keydown', event => {
      if (event.key === 'Enter' || event.key === ' ') {
        open();
      }
    });
    this._kernel = this._part('kernel');
    this._host = this._part('host');
    _model.changed.connect(() => this.refresh());
    this.refresh();
  }

  /** Say it again: after a poll, or when the page shows another notebook. */
  refresh(): void {
    const snapshot = this._model.snapshot;
    const kernelId = this._currentKernel();
    const held =
      snapshot === null || kernelId === null ? undefined : snapshot.kernel_memory?.[kernelId];
    this._kernel.textContent = held === undefined ? '' : `Kernel ${human(held)}`;
    this._host.textContent = snapshot === null ? '' : describeHost(snapshot);
    this._kernel.hidden = !this._kernel.textContent;
    this._host.hidden = !this._host.textContent;
    this.setHidden(this._kernel.hidden && this._host.hidden);
    const lines = [];
    if (held !== undefined) {
      lines.push(`This notebook’s kernel holds ${human(held)}: its own memory, not its claims’.`);
    }
    if (snapshot?.host) {
      lines.push(`The host, every process on it: ${describeHost(snapshot)} used.`);
    }
    if (snapshot !== null) {
      lines.push(describeCores(snapshot));
    }
    this.node.title = lines.filter(Boolean).join('\n');
  }

  private _part(name: string): HTMLElement {
    const node = document.createElement('span');
    node.className = `fluksio-lab-glance-part fluksio-lab-glance-${name}`;
    node.dataset.field = name;
    this.node.appendChild(node);
    return node;
  }

  private _kernel: HTMLElement;
  private _host: HTMLElement;
}
