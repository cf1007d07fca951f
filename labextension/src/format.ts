/**
 * Numbers and words as the Python side prints them (fluksio_nb/vocabulary.py
 * and queue.share_words), so the panel, the notices and `fluksio-nb` agree:
 * one spelling of a share, one format for a span and a clock, one phrase for
 * a claim that never got its share, one sentence for how a claim ended.
 */

/** Bytes in decimal units, like pydantic's ByteSize: `8.0GB`. */
export function human(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined) {
    return '-';
  }
  const units = ['B', 'KB', 'MB', 'GB', 'TB', 'PB'];
  let value = Math.max(0, bytes);
  let unit = 0;
  while (value >= 1000 && unit < units.length - 1) {
    value /= 1000;
    unit += 1;
  }
  return unit === 0 ? `${value}B` : `${value.toFixed(1)}${units[unit]}`;
}

/** Core ids as Linux writes them, and as the Python side prints them: `0-3,8`. */
export function cpuList(cores: number[]): string {
  const runs: [number, number][] = [];
  for (const core of [...cores].sort((a, b) => a - b)) {
    const last = runs[runs.length - 1];
    if (last && core === last[1] + 1) {
      last[1] = core;
    } else {
      runs.push([core, core]);
    }
  }
  return runs.map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`)).join(',');
}

/** Waiting claims the machine's books did not list, said as `fluksio-nb` says them. */
export function unlistedWords(unlisted: number): string {
  return `and ${unlisted} more of other users' claims, not listed`;
}

export function plural(n: number, one: string, many: string = one + 's'): string {
  return `${n} ${n === 1 ? one : many}`;
}

/** A place in a queue as people say it: `1st`, `2nd`, `11th`, `23rd`. */
export function ordinal(n: number): string {
  const teen = n % 100 >= 11 && n % 100 <= 13;
  const suffix = teen ? 'th' : ({ 1: 'st', 2: 'nd', 3: 'rd' } as Record<number, string>)[n % 10];
  return `${n}${suffix ?? 'th'}`;
}

/** A measured span, to the second under a minute: `0.4 s`, `12 s`, `2 min 5 s`, `1 h 3 min`. */
export function duration(seconds: number): string {
  seconds = Math.max(0, seconds);
  // Half up, as vocabulary.seconds rounds: both sides say the same tenth.
  const tenths = Math.floor(seconds * 10 + 0.5) / 10;
  if (tenths < 10) {
    return `${tenths.toFixed(1)} s`;
  }
  const whole = Math.floor(seconds + 0.5);
  if (whole < 60) {
    return `${whole} s`;
  }
  const minutes = Math.floor(whole / 60);
  if (minutes < 60) {
    return whole % 60 ? `${minutes} min ${whole % 60} s` : `${minutes} min`;
  }
  const hours = Math.floor(minutes / 60);
  return minutes % 60 ? `${hours} h ${minutes % 60} min` : `${hours} h`;
}

/** A guess, rounded as a guess should be: `under a minute`, `about 2 min`, `about 1 h 20 min`. */
export function roughly(seconds: number): string {
  if (seconds < 45) {
    return 'under a minute';
  }
  const minutes = Math.round(seconds / 60);
  if (minutes < 60) {
    return `about ${minutes} min`;
  }
  const tens = Math.round(minutes / 10) * 10;
  const hours = Math.floor(tens / 60);
  return tens % 60 ? `about ${hours} h ${tens % 60} min` : `about ${hours} h`;
}

/** An epoch time on the 24-hour clock, to the second, as every view says it: `15:19:17`. */
export function clock(epochSeconds: number): string {
  const at = new Date(epochSeconds * 1000);
  if (Number.isNaN(at.getTime())) {
    return '--:--:--';
  }
  return [at.getHours(), at.getMinutes(), at.getSeconds()]
    .map(n => String(n).padStart(2, '0'))
    .join(':');
}

/** What every view says of a claim that ended before it got its share. */
export const NEVER_RAN = 'never got its share';

/** `waited 0.1 s · ran 8.7 s`, or `waited 3.0 s · never got its share` (`ranS` null). */
export function timesWords(waitedS: number, ranS: number | null): string[] {
  return [`waited ${duration(waitedS)}`, ranS === null ? NEVER_RAN : `ran ${duration(ranS)}`];
}

/** A share as the claim line spells it: `cpus=2 (cores 0-1) gpus=1 (card 0) ram=4.0GB`. */
export function shareWords(share: {
  cpus: number;
  cores?: number[] | null;
  gpus?: number[] | null;
  gpu_bytes?: number | null;
  ram_bytes?: number | null;
}): string {
  const cores = share.cores?.length ? ` (cores ${cpuList(share.cores)})` : '';
  const words = [`cpus=${share.cpus}${cores}`];
  const cards = share.gpus ?? [];
  if (cards.length && share.gpu_bytes) {
    words.push(`a slice of card ${cards[0]} (gpu_ram=${human(share.gpu_bytes)})`);
  } else if (cards.length) {
    const which = `${cards.length === 1 ? 'card' : 'cards'} ${cards.join(',')}`;
    words.push(`gpus=${cards.length} (${which})`);
  }
  if (share.ram_bytes) {
    words.push(`ram=${human(share.ram_bytes)}`);
  }
  return words.join(' ');
}

/** What a waiting claim asks, as its line says it: `cpus=2 gpus=1 ram=4.0GB`. */
export function askedWords(asked: {
  cpus: number;
  gpus?: number | null;
  gpu_fraction?: number | null;
  gpu_bytes?: number | null;
  ram_bytes?: number | null;
}): string {
  const words = [`cpus=${asked.cpus}`];
  if (asked.gpus) {
    words.push(`gpus=${asked.gpus}`);
  } else if (asked.gpu_fraction) {
    words.push(`gpus=${asked.gpu_fraction}`);
  } else if (asked.gpu_bytes) {
    words.push(`gpu_ram=${human(asked.gpu_bytes)}`);
  }
  if (asked.ram_bytes) {
    words.push(`ram=${human(asked.ram_bytes)}`);
  }
  return words.join(' ');
}

/** How each ending reads in a sentence, as vocabulary.ENDED_AS says it. */
const ENDED_AS: Record<string, string> = {
  ok: 'finished',
  error: 'failed',
  interrupted: 'was interrupted',
  halted: 'was halted',
  'timed out': 'timed out',
  died: 'ended when its worker died',
  'kernel died': 'ended when its kernel died',
  cancelled: 'was cancelled',
  'time limit': 'reached its time limit',
  'idle cards': 'was ended for holding idle cards'
};

/**
 * How a claim ended, as a notice says it (vocabulary.ended_sentence without the quotes):
 * `failed after running 31 s: ValueError: the model diverged`.
 */
export function endedWords(ending: string, ranS: number | null, error: string | null): string {
  const how = ENDED_AS[ending] ?? `ended (${ending})`;
  const after = ranS === null ? ' before it got its share' : ` after running ${duration(ranS)}`;
  return `${how}${after}${error ? `: ${error}` : ''}`;
}

/**
 * Above a widget's saved view whose kernel is gone: the live monitor's own
 * stale mark (fluksio_nb/widget/widget.js), for a view that is now its saved text.
 */
export const STALE_SAVED = 'Stale: the kernel that showed this is gone; as it was when saved.';

/** What a stale monitor adds, live or saved: how to see the machine now. */
export const STALE_MONITOR = 'Run %claims again in a running kernel.';
