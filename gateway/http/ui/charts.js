// Small live line charts on a canvas: a time window, a few series, and marks (a failover, a
// worker restart) as labelled vertical lines on the time axis.

const COLORS = ["#2f6fde", "#e07a1f", "#7a56d6", "#1f9d55"];
const WINDOW_MS = 180_000;

function niceMax(value) {
  if (!(value > 0)) return 1;
  const exp = 10 ** Math.floor(Math.log10(value));
  const step = [1, 2, 4, 8, 10].find((s) => s * exp >= value); // a quarter of it is round
  return step * exp;
}

export function formatValue(value, unit) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (value === 0) return "0";
  const small = (v) => String(Number(v.toPrecision(2))); // 0.25, 1.5, 7.3
  if (unit === "ms") return value >= 1000 ? `${small(value / 1000)} s` : `${value < 10 ? small(value) : Math.round(value)} ms`;
  if (value >= 10_000) return `${(value / 1000).toFixed(1)}k`;
  return value < 10 && !Number.isInteger(value) ? small(value) : String(Math.round(value));
}

export class LineChart {
  constructor(canvas, { title, series, unit = "", minMax = 1 }) {
    this.minMax = minMax; // the y axis reaches at least this, so an idle chart reads well
    this.canvas = canvas;
    this.title = title;
    this.series = series.map((name, i) => ({ name, color: COLORS[i % COLORS.length] }));
    this.unit = unit;
    this.points = []; // {t, values: [number|null]}
    this.marks = []; // {t, label, color}
  }

  push(t, values) {
    this.points.push({ t, values });
    this.trim(t);
  }

  mark(t, label, color = "#d2423b") {
    this.marks.push({ t, label, color });
    this.trim(t);
  }

  trim(now) {
    const start = now - WINDOW_MS - 5000;
    while (this.points.length && this.points[0].t < start) this.points.shift();
    while (this.marks.length && this.marks[0].t < start) this.marks.shift();
  }

  draw(now = Date.now()) {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return; // hidden
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const pad = { left: 48, right: 10, top: 26, bottom: 20 };
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;
    const t0 = now - WINDOW_MS;
    const x = (t) => pad.left + ((t - t0) / WINDOW_MS) * plotW;
    let max = 0;
    for (const p of this.points) for (const v of p.values) if (v !== null && v > max) max = v;
    max = niceMax(Math.max(max * 1.1, this.minMax));
    const y = (v) => pad.top + plotH - (v / max) * plotH;

    // title and legend, with each series' latest value
    g.font = "600 12.5px system-ui, sans-serif";
    g.fillStyle = "#3b4452";
    g.textAlign = "left";
    g.textBaseline = "middle";
    g.fillText(this.title, 4, 11);
    const last = this.points.at(-1)?.values || [];
    let lx = width - 6;
    g.font = "11.5px system-ui, sans-serif";
    g.textAlign = "right";
    for (let i = this.series.length - 1; i >= 0; i -= 1) {
      const text = `${this.series[i].name} ${formatValue(last[i], this.unit)}`;
      g.fillStyle = "#3b4452";
      g.fillText(text, lx, 11);
      lx -= g.measureText(text).width + 6;
      g.fillStyle = this.series[i].color;
      g.fillRect(lx - 8, 7, 8, 8);
      lx -= 16;
    }

    // grid and axes
    g.strokeStyle = "#edf0f3";
    g.fillStyle = "#8a93a0";
    g.lineWidth = 1;
    g.textAlign = "right";
    for (let i = 0; i <= 4; i += 1) {
      const v = (max * i) / 4;
      const yy = Math.round(y(v)) + 0.5;
      g.beginPath();
      g.moveTo(pad.left, yy);
      g.lineTo(width - pad.right, yy);
      g.stroke();
      g.fillText(formatValue(v, this.unit), pad.left - 6, yy);
    }
    g.textAlign = "center";
    g.textBaseline = "top";
    for (let s = 0; s <= WINDOW_MS / 1000; s += 60) {
      g.fillText(s === 0 ? "now" : `-${s / 60}m`, x(now - s * 1000), height - pad.bottom + 5);
    }

    // marks
    g.save();
    g.beginPath();
    g.rect(pad.left, 0, plotW, height);
    g.clip();
    g.textAlign = "left";
    g.textBaseline = "top";
    g.font = "10.5px system-ui, sans-serif";
    const labelled = []; // x of the marks drawn so far: labels of close marks stack down
    for (const m of this.marks) {
      const xx = Math.round(x(m.t)) + 0.5;
      const row = labelled.filter((other) => Math.abs(other - xx) < 90).length;
      labelled.push(xx);
      g.strokeStyle = m.color;
      g.setLineDash([3, 3]);
      g.beginPath();
      g.moveTo(xx, pad.top);
      g.lineTo(xx, pad.top + plotH);
      g.stroke();
      g.setLineDash([]);
      g.fillStyle = m.color;
      const fitsRight = xx + 3 + g.measureText(m.label).width < width - pad.right;
      g.textAlign = fitsRight ? "left" : "right";
      g.fillText(m.label, fitsRight ? xx + 3 : xx - 3, pad.top + 2 + 12 * (row % 4));
    }

    // lines (a null value breaks a line)
    g.lineWidth = 1.8;
    g.lineJoin = "round";
    this.series.forEach((s, i) => {
      g.strokeStyle = s.color;
      g.beginPath();
      let drawing = false;
      for (const p of this.points) {
        const v = p.values[i];
        if (v === null || v === undefined) {
          drawing = false;
          continue;
        }
        if (drawing) g.lineTo(x(p.t), y(v));
        else g.moveTo(x(p.t), y(v));
        drawing = true;
      }
      g.stroke();
    });
    g.restore();
  }
}
