// The store chart: disk use as stacked bars (live journals, archive tier, damaged, reserved) against
// the soft budget and the hard limit, drawn as inline SVG at the container's own width. With neither
// set there is no capacity to fill: no track is drawn behind the bars, and the axis runs to a round
// size at least twice the use, so the bars show how much, never how full.

import { s } from "./dom.js";
import { bytes } from "./format.js";

export const PARTS = [
  { state: "active", label: "Journals (active)", css: "seg-active" },
  { state: "parked", label: "Archive tier (parked)", css: "seg-parked" },
  { state: "damaged", label: "Damaged", css: "seg-damaged" },
];

function percent(fraction) {
  const value = fraction * 100;
  return `${value < 10 ? value.toFixed(1) : Math.round(value)}%`;
}

const BAR = 26;
const GAP = 30;
const LABEL = 78;
const TOP = 30;

const MIN_SEGMENT = 3; // px: a few KiB next to a budget of GiB still shows

/** The smallest of 1, 2, 5, 10, 20, 50, 100, 200, 500 × 1024^k bytes that is at least ``n``. */
export function roundSize(n) {
  let unit = 1;
  while (unit * 1024 <= n) unit *= 1024;
  for (const m of [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]) if (m * unit >= n) return m * unit;
  return 1024 * unit;
}

function bar(y, x0, width, segments, scale, title, total, track) {
  const group = s("g", { class: "bar" });
  group.append(s("text", { x: 0, y: y + BAR / 2 + 4, class: "bar-label" }, title));
  if (track) group.append(s("rect", { x: x0, y, width, height: BAR, class: "track" }));
  let x = x0;
  for (const seg of segments) {
    if (seg.bytes <= 0) continue;
    const w = Math.max(seg.bytes * scale, MIN_SEGMENT);
    group.append(s("rect", { x, y, width: w, height: BAR, class: seg.css }, s("title", {}, `${seg.label}: ${bytes(seg.bytes)}`)));
    x += w;
  }
  // the total next to the filled part, or inside it when there is no room after it
  const roomAfter = x + 8 + total.length * 7 < x0 + width;
  group.append(
    s("text", { x: roomAfter ? x + 8 : x - 8, y: y + BAR / 2 + 4, "text-anchor": roomAfter ? "start" : "end", class: roomAfter ? "total" : "total inside" }, total),
  );
  return group;
}

function marker(x, y0, y1, css, text, anchor) {
  return s(
    "g",
    { class: css },
    s("line", { x1: x, x2: x, y1: y0, y2: y1 }),
    s("text", { x, y: y0 - 6, "text-anchor": anchor }, text),
  );
}

/**
 * Draw ``store`` (the answer of GET /console/store) into ``container``.
 * Returns the figures it drew, for the text next to the chart.
 */
export function drawStore(container, store) {
  const width = Math.max(280, Math.floor(container.clientWidth || 600));
  const plot = width - LABEL - 12;
  const everyone = PARTS.map((p) => ({ ...p, bytes: store.store[p.state]?.bytes || 0 }));
  everyone.push({ state: "reserved", label: "Reserved by writes", css: "seg-reserved", bytes: store.reserved_bytes });
  const mine = PARTS.map((p) => ({ ...p, bytes: store.mine[p.state]?.bytes || 0 }));
  const total = everyone.reduce((sum, seg) => sum + seg.bytes, 0);
  const mineTotal = mine.reduce((sum, seg) => sum + seg.bytes, 0);
  const allLabel =
    bytes(store.used_bytes) + (store.budget_bytes ? ` · ${percent(store.used_bytes / store.budget_bytes)} of budget` : "");
  const capacity = Math.max(store.budget_bytes || 0, store.hard_limit_bytes || 0);
  const top = capacity > 0 ? Math.max(total, capacity) * 1.06 : roundSize(Math.max(total, 1) * 2);
  const scale = plot / top;
  const height = TOP + 2 * BAR + GAP + 28;
  const summary =
    `${bytes(store.used_bytes)} used` +
    (store.budget_bytes !== null ? ` of a ${bytes(store.budget_bytes)} budget` : ", no budget set") +
    (store.hard_limit_bytes !== null ? `, hard limit ${bytes(store.hard_limit_bytes)}` : "") +
    `; archive tier ${bytes(store.store.parked?.bytes || 0)}; yours ${bytes(mineTotal)}`;
  const chart = s(
    "svg",
    { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-labelledby": "store-chart-title" },
    s("title", { id: "store-chart-title" }, `Disk use: ${summary}`),
    bar(TOP, LABEL, plot, everyone, scale, "All owners", allLabel, capacity > 0),
    bar(TOP + BAR + GAP, LABEL, plot, mine, scale, "Yours", bytes(mineTotal), capacity > 0),
  );
  if (capacity === 0) {
    chart.append(s("text", { x: LABEL + plot, y: TOP - 8, "text-anchor": "end", class: "tick no-budget" }, "no budget or limit set"));
  }
  const y1 = TOP + BAR + 4;
  if (store.budget_bytes !== null) {
    const x = LABEL + store.budget_bytes * scale;
    chart.append(marker(x, TOP, y1, "marker budget", `budget ${bytes(store.budget_bytes)}`, x > width * 0.7 ? "end" : "middle"));
  }
  if (store.hard_limit_bytes !== null) {
    const x = LABEL + store.hard_limit_bytes * scale;
    chart.append(marker(x, TOP - 14, y1, "marker limit", `limit ${bytes(store.hard_limit_bytes)}`, "end"));
  }
  const axisY = TOP + 2 * BAR + GAP + 18;
  for (const fraction of [0, 0.5, 1]) {
    const x = LABEL + plot * fraction;
    chart.append(
      s("text", { x, y: axisY, class: "tick", "text-anchor": fraction === 0 ? "start" : fraction === 1 ? "end" : "middle" }, bytes(Math.round(top * fraction))),
    );
  }
  for (const text of chart.querySelectorAll(".total")) chart.append(text); // drawn over the marker lines
  container.replaceChildren(chart);
  return { everyone, mine, summary };
}
