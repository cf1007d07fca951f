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

export function plural(n: number, one: string, many: string = one + 's'): string {
  return `${n} ${n === 1 ? one : many}`;
}
