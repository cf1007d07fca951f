/**
 * The server extension's routes, typed as fluksio_nb/server.py sends them.
 *
 * URLs start from the server's base URL, so the extension works behind
 * JupyterHub's /user/<name>/ prefix as well as on a bare server.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface Amount {
  total: number;
  free: number;
}

export interface Readings {
  rss_bytes: number;
  peak_rss_bytes: number;
  /** Share of the whole machine's cores, 0 to 100. */
  cpu_percent: number;
  processes: number;
  at: number;
  /** Card memory the claim held on all its cards; null where no card was read. */
  gpu_bytes?: number | null;
  peak_gpu_bytes?: number | null;
  gpu_percent?: number | null;
  /** The worker was stopped by a signal (SIGSTOP) at this time, and is still stopped. */
  stopped_since?: number | null;
}

/** One of a claim's cards as the server read it: what the claim holds of it, and the card. */
export interface ClaimCard {
  index: number;
  held_bytes: number;
  utilisation_percent: number | null;
  used_bytes: number | null;
  total_bytes: number | null;
}

/** What a running claim holds of its cards; absent (null) where nothing read them. */
export interface ClaimGpu {
  cards: ClaimCard[];
  held_bytes: number | null;
  peak_bytes: number | null;
  percent: number | null;
  /** As every view says it: `GPU 1.2GB on card 0 (38% busy), peak 2.0GB`. */
  text: string;
}

/** A card as read by the server: NVML or nvidia-smi. */
export interface Card {
  index: number;
  uuid: string;
  utilisation_percent: number | null;
  used_bytes: number | null;
  total_bytes: number | null;
  /** The running claims holding it. */
  tickets: number[];
  /** `card 0: 38% busy, 2.0GB/16.0GB used`. */
  text: string;
}

/** Card memory held by a process with no claim on that card above it. */
export interface Squatter {
  card: number;
  /** Null when the process is outside this machine's view (another container). */
  pid: number | null;
  driver_pid: number;
  user: string | null;
  used_bytes: number | null;
  /** `card 1: 3.2GB held by pid 4242 (bob), no claim`. */
  text: string;
}

interface Claim {
  ticket: number;
  /** Null for another user's claim whose owner keeps labels private. */
  label: string | null;
  since: number;
  pid: number;
  kernel_id: string | null;
  /** The notebook the kernel was started for, as the kernel was told. */
  notebook: string | null;
  user: string | null;
  /** The notebook's path on this server, when this server runs the kernel. */
  path: string | null;
  /** Whether it is this server's user's. */
  mine: boolean;
  /** Whether this server's user may cancel it: their own, or anyone's for an admin. */
  can_cancel: boolean;
}

export interface RunningClaim extends Claim {
  allocation: {
    cpus: number;
    gpus: number[];
    ram_bytes: number;
    cores?: number[];
    /** The card memory of a slice of its one card; absent for whole cards. */
    gpu_bytes?: number;
  };
  readings: Readings | null;
  gpu?: ClaimGpu | null;
  /**
   * What the machine's books warn of while it runs, in their words: its time
   * limit near, naming the admin's `max_hours`. Absent or null when nothing.
   */
  warning?: string | null;
}

/** How long a queued claim may still wait, and what the guess rests on. */
export interface ExpectedWait {
  /** Null when the server cannot tell. */
  seconds: number | null;
  /** What the guess is from, or why there is none, in words. */
  why: string;
}

export interface WaitingClaim extends Claim {
  /** Its 1-based place in the machine's queue: what people read, not the ticket. */
  position: number;
  asked: {
    cpus: number;
    gpus: number;
    ram_bytes: number;
    /** A slice of one card: a fraction of it, or bytes of its memory. */
    gpu_fraction?: number;
    gpu_bytes?: number;
  };
  /** Absent from a server older than the expected-wait guess. */
  expected_wait?: ExpectedWait;
}

/** One card as the books hold it: whole, shared by slices, or idle. */
export interface CardRow {
  index: number;
  claims: number;
  whole: boolean;
  held_bytes: number;
  total_bytes: number;
}

/** The host as the server's history last read it (every process on it, not only claims). */
export interface HostNow {
  at: number;
  /** Of the whole machine, 0 to 100. */
  cpu_percent: number;
  memory_used_bytes: number;
  memory_total_bytes: number;
}

export interface Snapshot {
  /** `kept_back`: the machine's cores the books do not hand out, kept for kernels. */
  cpus: Amount & { kept_back?: number };
  /** The host now; null before the server's first reading, absent from an older server. */
  host?: HostNow | null;
  /** This server's kernels' own resident memory, by kernel id. */
  kernel_memory?: Record<string, number>;
  gpus: Amount & { free_ids: number[]; cards?: CardRow[] };
  ram_bytes: Amount;
  running: RunningClaim[];
  /** On books every user shares, only the first of other users' claims, and all of yours. */
  waiting: WaitingClaim[];
  /**
   * How many more of other users' claims wait than `waiting` lists: the
   * machine's books keep a snapshot short whatever one user queues. Absent
   * where the books list every claim.
   */
  waiting_unlisted?: number;
  /** Where the machine's ledger is; null when every kernel keeps its own books. */
  ledger: string | null;
  user: string;
  /** What holds claims to each resource: the OS (affinity, a cgroup) or less. */
  enforcement?: Record<string, Enforcement>;
  /** `nvml`, `nvidia-smi`, or null when nothing read the cards. */
  cards_source?: string | null;
  /** Every card as read; empty when nothing read them. */
  cards?: Card[];
  /** Null where it cannot be known: no card reading, or books that see one kernel only. */
  squatters?: Squatter[] | null;
  /** This server's kernels the OS stopped at the admin's kernel_ram, newest first. */
  kernel_stops?: KernelStop[];
}

/** A kernel the OS stopped at the admin's `kernel_ram`, and why, in words. */
export interface KernelStop {
  kernel_id: string;
  /** When its provisioner saw it stopped, in seconds since the epoch. */
  at: number;
  kernel_ram: number;
  peak_bytes: number | null;
  /** The cap, where the admin set it, and how to claim more. */
  why: string;
  /** Its notebook, when this server serves one for it. */
  path: string | null;
}

/** Every claim waiting on the machine, listed in `waiting` or not. */
export function waitingCount(snapshot: Snapshot): number {
  return snapshot.waiting.length + (snapshot.waiting_unlisted ?? 0);
}

export interface Enforcement {
  /** What a person reads: `own cores (cpuset)`, `enforced (cgroup v1)`. */
  label: string;
  /** What acts: `cpuset`, `affinity`, `cgroup v1`, `sampler`, `thread variables`. */
  by: string;
  /** Why the OS does not enforce it, where it does not. */
  why: string;
}

/** One reading of a card in the machine's history; null where the card did not say. */
export interface CardPoint {
  index: number;
  used_bytes: number | null;
  total_bytes: number | null;
  utilisation_percent: number | null;
}

/** One reading of the whole machine. */
export interface HistoryPoint {
  at: number;
  /** Of the whole machine, 0 to 100. */
  cpu_percent: number;
  /** What processes outside every claim used; null where it could not be told apart. */
  cpu_outside_claims_percent: number | null;
  memory_used_bytes: number;
  memory_total_bytes: number;
  cards: CardPoint[];
}

/** The machine over the last `span_s` seconds, oldest first. */
export interface History {
  span_s: number;
  interval_s: number;
  points: HistoryPoint[];
}

/** How a claim ended, as the usage records keep it. */
export type Ending =
  | 'ok'
  | 'error'
  | 'interrupted'
  | 'halted'
  | 'timed out'
  | 'died'
  | 'cancelled'
  /** Stopped at the longest time the admin lets one claim run (`max_hours`). */
  | 'time limit'
  /** Ended by the machine's books: its cards sat idle while another claim waited. */
  | 'idle cards'
  /** Written for a kernel killed outright, by whoever saw it go: no peak is known. */
  | 'kernel died';

/** A claim that has ended, anyone's on this machine. */
export interface FinishedClaim {
  /** An id, never shown: people read labels and positions. Null in older records. */
  ticket: number | null;
  label: string;
  user: string;
  notebook: string | null;
  ending: Ending | string;
  asked_at: number;
  started_at: number | null;
  ended_at: number;
  waited_s: number;
  ran_s: number | null;
  peak_rss_bytes: number | null;
  peak_gpu_bytes: number | null;
  /** The share it held; 0 cpus for one that never got it. Missing from older servers. */
  cpus?: number;
  gpus?: number[];
  ram_bytes?: number;
  /**
   * Why it failed, in one line (`ValueError: the model diverged`); null when it
   * ended well. Only ever the user's own: the server reads no one else's records.
   */
  error?: string | null;
  /** Its colour in every view: `good`, `bad` or `stopped` (vocabulary.MARKS). */
  mark?: 'good' | 'bad' | 'stopped';
}

/** What the server answered when it did not do what was asked. */
export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

async function request(path: string, init: RequestInit = {}): Promise<any> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'fluksio/api', path);
  const response = await ServerConnection.makeRequest(url, init, settings);
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    // The server's message says what is wrong and what to do; show it as is.
    throw new ApiError(body.message || `${response.status} ${response.statusText}`, response.status);
  }
  return body;
}

export function fetchSnapshot(): Promise<Snapshot> {
  return request('snapshot');
}

export function cancelClaim(ticket: number): Promise<void> {
  return request(`claims/${ticket}/cancel`, { method: 'POST' });
}

export function fetchHistory(): Promise<History> {
  return request('history');
}

/** The last claims to end on this machine, newest first, at most 20. */
export async function fetchFinished(): Promise<FinishedClaim[]> {
  return (await request('finished')).claims;
}
