// Reading the gateway's Prometheus text (GET /metrics): samples, sums over label sets, and
// histogram quantiles over the change between two scrapes (as PromQL's histogram_quantile).

const LINE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

export function parsePrometheus(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = LINE.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] || "").matchAll(LABEL)) {
      labels[key] = value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    samples.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return new Scrape(samples);
}

export class Scrape {
  constructor(samples) {
    this.samples = samples;
    this.at = Date.now();
  }

  select(name, where = {}) {
    return this.samples.filter((s) => s.name === name
      && Object.entries(where).every(([k, v]) => s.labels[k] === v));
  }

  sum(name, where = {}) {
    const found = this.select(name, where);
    return found.length ? found.reduce((total, s) => total + s.value, 0) : null;
  }

  max(name, where = {}) {
    const found = this.select(name, where);
    return found.length ? Math.max(...found.map((s) => s.value)) : null;
  }

  // label value -> summed value, for one label (e.g. worker_id)
  byLabel(name, label, where = {}) {
    const out = new Map();
    for (const s of this.select(name, where)) {
      const key = s.labels[label];
      out.set(key, (out.get(key) || 0) + s.value);
    }
    return out;
  }

  // Cumulative bucket counts of a histogram summed over every label set: [[le, count]].
  buckets(name) {
    const byLe = new Map();
    for (const s of this.select(`${name}_bucket`)) {
      const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
      byLe.set(le, (byLe.get(le) || 0) + s.value);
    }
    return [...byLe.entries()].sort((a, b) => a[0] - b[0]);
  }
}

// The q-quantile of the observations made between two scrapes (null: none were made).
export function quantileBetween(older, newer, name, q) {
  const before = new Map(older.buckets(name));
  const deltas = newer.buckets(name).map(([le, count]) => [le, count - (before.get(le) || 0)]);
  const total = deltas.length ? deltas.at(-1)[1] : 0;
  // None observed, or the counters went back (a new gateway process): no answer this time.
  if (!(total > 0) || deltas.some(([, count]) => count < 0)) return null;
  const rank = q * total;
  let lowerLe = 0;
  let lowerCount = 0;
  for (const [le, count] of deltas) {
    if (count >= rank) {
      if (le === Infinity) return lowerLe; // beyond the last finite bucket
      const inBucket = count - lowerCount;
      return inBucket > 0 ? lowerLe + ((le - lowerLe) * (rank - lowerCount)) / inBucket : le;
    }
    lowerLe = le;
    lowerCount = count;
  }
  return lowerLe;
}
