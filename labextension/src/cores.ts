/**
 * The cores kept back, said once for the status bar's hover and the panel.
 *
 * The books hand out the machine's cores less `reserve_cpus`, kept for
 * kernels and the server. Without this, a 2-core machine says "1" in every
 * view, and nobody can tell where the other core went.
 */
import { plural } from './format';
import { Snapshot } from './api';

/** What the machine has and keeps back: `2 cores: 1 for claims, 1 kept back for kernels`. */
export function describeCores(snapshot: Snapshot): string {
  const { total, kept_back: kept } = snapshot.cpus;
  if (kept === undefined) {
    return '';
  }
  if (kept === 0) {
    return `${plural(total, 'core')}, all for claims: none kept back for kernels`;
  }
  return (
    `${plural(total + kept, 'core')}: ${total} for claims, ` +
    `${kept} kept back for kernels and the server`
  );
}

