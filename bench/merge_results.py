#!/usr/bin/env python3
"""Merges a `moekit bench --json` run with transformers' timings (tools/hf_bench.py) of the same shapes.

Writes one JSON file: our records under "records", transformers' under "anchor", and the side-by-side
table (markdown) for docs/perf.md: per shape and token count, our best (backend, graph or plain),
transformers' best (backend), the ratio transformers / moekit (above 1: moekit is faster), and the
ratio of our best to the roofline floor. Optionally one PNG plot per shape through gnuplot: time vs
tokens, log-log, one line per moekit backend, transformers' best, the floor.

transformers' records are read from its JSON, or, where hf_bench.py did not finish, from the JSON
lines it printed to its log.

  python3 bench/merge_results.py --ours moekit.json --anchor hf.json [--anchor-log hf.log]
                                 --out bench/results/h200.json --table table.md [--plots DIR]
"""
import argparse, json, os, shutil, subprocess, sys


# Distinct colours that read on white (gnuplot's default fifth colour is a pale yellow).
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]


def load_json(path):
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def anchor_from_log(path):
    """Records printed one per line by hf_bench.py (its ceilings line too)."""
    out = {"records": []}
    if not path or not os.path.exists(path):
        return out
    for line in open(path, errors="replace"):
        line = line.strip()
        if line.startswith("ceilings:"):
            # "ceilings: bf16 GEMM 788 TFLOP/s, copy 4.30 TB/s"
            try:
                parts = line.replace(",", " ").split()
                out["peak_tflops"] = float(parts[parts.index("TFLOP/s") - 1])
                out["copy_tbps"] = float(parts[parts.index("TB/s") - 1])
            except (ValueError, IndexError):
                pass
        elif line.startswith("{"):
            try:
                out["records"].append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def best(records, key):
    """The fastest timed record per (shape, tokens)."""
    out = {}
    for r in records:
        if r.get("median_us") is None:
            continue
        k = (r["shape"], int(r["tokens"]))
        if k not in out or r["median_us"] < out[k]["median_us"]:
            out[k] = r
    return out


def fmt_us(v):
    return "" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def table(ours, anchor):
    ob = best(ours.get("records", []), "backend")
    ab = best(anchor.get("records", []), "impl")
    shapes = []
    for r in ours.get("records", []) + anchor.get("records", []):
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    rows = ["| shape | T | floor us | moekit best us | backend | transformers best us | impl | transformers / moekit | moekit / floor |",
            "|---|---|---|---|---|---|---|---|---|"]
    for s in shapes:
        tokens = sorted({t for (sh, t) in list(ob) + list(ab) if sh == s})
        for t in tokens:
            o, a = ob.get((s, t)), ab.get((s, t))
            floor = o["floor_us"] if o else (a or {}).get("floor_us")
            name = (o["backend"] + (" (graph)" if o.get("graph") else "")) if o else ""
            aname = (a["impl"] + (" compiled" if a.get("compile") else "")) if a else ""
            ratio = f"{a['median_us'] / o['median_us']:.2f}x" if o and a else ""
            fr = f"{o['floor_ratio']:.2f}" if o else ""
            rows.append(f"| {s} | {t} | {fmt_us(floor)} | {fmt_us(o and o['median_us'])} | {name} | "
                        f"{fmt_us(a and a['median_us'])} | {aname} | {ratio} | {fr} |")
    return "\n".join(rows) + "\n"


def plots(ours, anchor, outdir):
    if not shutil.which("gnuplot"):
        print("merge: gnuplot not found, no plots", file=sys.stderr)
        return []
    os.makedirs(outdir, exist_ok=True)
    ab = best(anchor.get("records", []), "impl")
    made = []
    shapes = []
    for r in ours.get("records", []):
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    for s in shapes:
        series = {}
        floor = {}
        for r in ours["records"]:
            if r["shape"] != s:
                continue
            name = r["backend"] + (" (graph)" if r.get("graph") else "")
            series.setdefault(name, {})[r["tokens"]] = r["median_us"]
            floor[r["tokens"]] = r["floor_us"]
        hf = {t: r["median_us"] for (sh, t), r in ab.items() if sh == s}
        path = os.path.join(outdir, f"{s}.png")
        lines = []
        data = []
        for i, (name, pts) in enumerate(sorted(series.items())):
            color = COLORS[i % len(COLORS)]
            lines.append(f"'-' using 1:2 with linespoints lw 2 pt {5 + i % 8} lc rgb '{color}' title '{name}' noenhanced")
            data.append("".join(f"{t} {v}\n" for t, v in sorted(pts.items())) + "e\n")
        if hf:
            lines.append("'-' using 1:2 with linespoints lw 3 lc rgb 'red' pt 2 title 'transformers best' noenhanced")
            data.append("".join(f"{t} {v}\n" for t, v in sorted(hf.items())) + "e\n")
        lines.append("'-' using 1:2 with lines dt 2 lw 2 lc rgb 'black' title 'roofline floor'")
        data.append("".join(f"{t} {v}\n" for t, v in sorted(floor.items())) + "e\n")
        card = ours.get("card", "")
        tokens = sorted(set(floor) | set(hf))
        xtics = ", ".join(str(t) for t in tokens)
        gp = (f"set terminal pngcairo size 1100,700 enhanced font 'DejaVu Sans,11'\nset output '{path}'\n"
              "set logscale xy\nset grid xtics ytics mxtics mytics lc rgb '#dddddd'\n"
              "set xlabel 'tokens T'\nset ylabel 'time per forward (microseconds, median)'\n"
              "set key outside right top box\nset format y '10^{%L}'\n"
              f"set xtics ({xtics})\nset xrange [{tokens[0] / 1.3}:{tokens[-1] * 1.3}]\n"
              f"set title '{s}: bf16 experts forward on {card}' noenhanced\n"
              "plot " + ", ".join(lines) + "\n" + "".join(data))
        subprocess.run(["gnuplot"], input=gp.encode(), check=True)
        made.append(path)
    return made


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--anchor")
    ap.add_argument("--anchor-log")
    ap.add_argument("--out", required=True)
    ap.add_argument("--table")
    ap.add_argument("--plots")
    a = ap.parse_args()
    ours = load_json(a.ours) or {"records": []}
    anchor = load_json(a.anchor)
    if anchor is None:
        anchor = anchor_from_log(a.anchor_log)
        anchor["source"] = "log (hf_bench.py did not finish)"
    merged = dict(ours)
    merged["anchor"] = anchor
    with open(a.out, "w") as f:
        json.dump(merged, f, indent=1)
    t = table(ours, anchor)
    if a.table:
        with open(a.table, "w") as f:
            f.write(t)
    print(t)
    if a.plots:
        for p in plots(ours, anchor, a.plots):
            print("plot:", p)


if __name__ == "__main__":
    main()
