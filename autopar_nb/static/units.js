// Sizes, times and counts as text, by the rules of autopar_nb/units.py (three significant digits, the unit chosen per
// value): one implementation for every front end (dashboard.py and model.py put this file in front of theirs).
const sig3 = (x) => (Math.abs(x) < 10 ? x.toFixed(2) : Math.abs(x) < 100 ? x.toFixed(1) : x.toFixed(0));
function bytes(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let x = n, i = 0;
  while (Math.abs(x) >= 1024 * 0.9995 && i < units.length - 1) { x /= 1024; i += 1; }
  return i === 0 ? `${x.toFixed(0)} B` : `${sig3(x)} ${units[i]}`;
}
function secs(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "–";
  if (s === 0) return "0 s";
  for (const [scale, unit] of [[1, "s"], [1e-3, "ms"], [1e-6, "µs"], [1e-9, "ns"]]) {
    if (Math.abs(s) >= scale * 0.9995 || unit === "ns") return `${sig3(s / scale)} ${unit}`;
  }
  return `${s} s`;
}
function count(x, unit = "") {
  if (x === null || x === undefined) return "–";
  for (const [scale, p] of [[1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (Math.abs(x) >= scale * 0.9995) return `${sig3(x / scale)}${p}${unit}`;
  }
  return `${x.toFixed(0)}${unit}`;
}
