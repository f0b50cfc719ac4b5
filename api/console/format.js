// Numbers, sizes and times as a person reads them.

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  let value = Number(n);
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(value < 10 ? 2 : 1)} ${UNITS[unit]}`;
}

export function count(n) {
  return n === null || n === undefined ? "—" : Number(n).toLocaleString("en-US");
}

/** Seconds since the epoch -> "2024-05-01 12:30:05" (local time). */
export function when(seconds) {
  if (!seconds) return "—";
  const d = new Date(seconds * 1000);
  const pad = (v) => String(v).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

/** Seconds since the epoch -> "5 min ago". */
export function ago(seconds) {
  if (!seconds) return "never";
  const s = Math.max(0, Date.now() / 1000 - seconds);
  if (s < 45) return "just now";
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

export function iso(seconds) {
  return seconds ? new Date(seconds * 1000).toISOString() : "";
}
