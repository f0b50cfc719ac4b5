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

/** ``n`` and the noun it counts: "1 session", "3 sessions" ("—" when unknown). */
export function plural(n, noun, nouns = `${noun}s`) {
  if (n === null || n === undefined) return `— ${nouns}`;
  return `${count(n)} ${Number(n) === 1 ? noun : nouns}`;
}

const pad = (v) => String(v).padStart(2, "0");

/** The browser's offset from UTC on that date: "UTC", "UTC+02:00", "UTC-05:30". */
function zone(d) {
  const east = -d.getTimezoneOffset();
  if (east === 0) return "UTC";
  const minutes = Math.abs(east);
  return `UTC${east > 0 ? "+" : "-"}${pad(Math.floor(minutes / 60))}:${pad(minutes % 60)}`;
}

/** Seconds since the epoch -> "2024-05-01 12:30:05 UTC+02:00" (local time, with its zone). */
export function when(seconds) {
  if (!seconds) return "—";
  const d = new Date(seconds * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())} ${zone(d)}`;
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
