#!/usr/bin/env python3
"""Reads a bench/kernel_trace.cpp CSV: per graph (the most replayed first), the median replay as a timeline.

For each kernel of a replay, in start order: its start and end from the replay's first start, its duration, and its
advance (how far its end moves the latest end so far: the kernels whose advance is large are the chain's critical
path; with Programmatic Dependent Launch a kernel starts before the one before it ends). Medians over replays.

Usage: bench/kernel_trace.py TRACE.csv [--graphs N] [--skip N] [--json OUT]
"""
import argparse
import csv
import json
import re
import statistics
from collections import defaultdict


def short(name, width=58):
    base = name.replace("(anonymous namespace)::", "")
    base = base.split("(")[0] if "(" in base else base
    base = re.sub(r"^(void |)", "", base)
    # drop namespaces, keep the kernel's own name and the start of its template arguments
    head = base.split("<")[0].split("::")[-1]
    tmpl = base[len(base.split("<")[0]):]
    s = head + (tmpl if tmpl else "")
    return s if len(s) <= width else s[: width - 3] + "..."


def replays(rows):
    """Splits one graph's rows (sorted by start) into replays: a replay ends where a node id comes again."""
    out, seen, cur = [], set(), []
    for r in rows:
        if r["node"] in seen:
            out.append(cur)
            cur, seen = [], set()
        cur.append(r)
        seen.add(r["node"])
    if cur:
        out.append(cur)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--graphs", type=int, default=2, help="graphs to print, the most replayed first")
    ap.add_argument("--skip", type=int, default=2, help="replays skipped at the start of each graph (warm-up)")
    ap.add_argument("--json", help="write the summary here too")
    a = ap.parse_args()
    by_graph = defaultdict(list)
    plain = 0
    with open(a.trace) as f:
        for r in csv.DictReader(f):
            for k in ("start_ns", "end_ns", "graph", "node", "grid_x", "grid_y", "grid_z", "regs", "smem"):
                r[k] = int(r[k])
            if r["graph"] == 0:
                plain += 1
                continue
            by_graph[r["graph"]].append(r)
    summary = {"plain_kernels": plain, "graphs": []}
    order = sorted(by_graph, key=lambda g: -len(by_graph[g]))
    for g in order[: a.graphs]:
        rows = sorted(by_graph[g], key=lambda r: r["start_ns"])
        reps = replays(rows)
        n_nodes = max(len(r) for r in reps)
        reps = [r for r in reps if len(r) == n_nodes][a.skip:]
        if not reps:
            continue
        spans, periods = [], []
        per = defaultdict(lambda: {"start": [], "end": [], "dur": [], "adv": []})
        for i, rep in enumerate(reps):
            t0 = min(r["start_ns"] for r in rep)
            t1 = max(r["end_ns"] for r in rep)
            spans.append((t1 - t0) / 1e3)
            if i + 1 < len(reps):
                periods.append((min(r["start_ns"] for r in reps[i + 1]) - t0) / 1e3)
            front = t0
            for pos, r in enumerate(rep):
                p = per[pos]
                p["name"], p["grid"] = r["name"], (r["grid_x"], r["grid_y"], r["grid_z"])
                p["block"] = r["block_x"]
                p["start"].append((r["start_ns"] - t0) / 1e3)
                p["end"].append((r["end_ns"] - t0) / 1e3)
                p["dur"].append((r["end_ns"] - r["start_ns"]) / 1e3)
                p["adv"].append(max(0, r["end_ns"] - front) / 1e3)
                front = max(front, r["end_ns"])
        med = statistics.median
        print(f"graph {g}: {len(reps)} replays of {n_nodes} kernels; span median {med(spans):.1f} us "
              f"(min {min(spans):.1f}), start to start {med(periods) if periods else 0:.1f} us")
        print(f"{'#':>3} {'start':>7} {'end':>7} {'dur':>6} {'adv':>6}  {'grid':>12} {'blk':>4}  kernel")
        kinds = defaultdict(lambda: [0.0, 0.0, 0])
        items = []
        for pos in range(n_nodes):
            p = per[pos]
            s, e, d, v = med(p["start"]), med(p["end"]), med(p["dur"]), med(p["adv"])
            gx, gy, gz = p["grid"]
            print(f"{pos:>3} {s:7.1f} {e:7.1f} {d:6.1f} {v:6.1f}  {f'{gx}x{gy}x{gz}':>12} {p['block']:>4}  "
                  f"{short(p['name'])}")
            k = short(p["name"], 40)
            kinds[k][0] += d
            kinds[k][1] += v
            kinds[k][2] += 1
            items.append({"pos": pos, "name": p["name"], "start_us": s, "end_us": e, "dur_us": d, "adv_us": v,
                          "grid": [gx, gy, gz], "block": p["block"]})
        print("by kernel (sum of medians): advance / duration us, count")
        for k, (d, v, n) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            print(f"  {v:7.1f} / {d:7.1f}  x{n:<3} {k}")
        summary["graphs"].append({"graph": g, "replays": len(reps), "kernels": n_nodes, "span_us": med(spans),
                                  "period_us": med(periods) if periods else None, "items": items})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
