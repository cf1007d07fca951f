/** Numbers as the Python side prints them, so the panel and `fluksio-nb` agree. */

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
  if (seconds < 10) {
    return `${Math.max(0, seconds).toFixed(1)} s`;
  }
  const whole = Math.round(seconds);
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

/** An epoch time as a clock reading in the user's locale, to the second. */
export function clock(epochSeconds: number): string {
  return new Date(epochSeconds * 1000).toLocaleTimeString();
}
