#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Draws one step of a tierstate trace (Chrome trace-event JSON, from tracer::save, the
examples' --trace, or optimizer.trace() in PyTorch) as a PNG timeline: a row per thread and
per I/O staging buffer, a bar per phase, each chunk's number on its read, compute and write.

    python3 bench/trace_png.py step.json step.png [--step N] [--title TEXT]

--step picks the N-th step in the file (from 0; default: the last). Needs matplotlib.
"""
import argparse
import json
import sys

COLORS = {
    "step": "#d9d9d9", "check": "#e7298a", "reduce": "#88419d",
    "read": "#2b8cbe", "read_wait": "#f03b20", "grads": "#fd8d3c",
    "compute": "#31a354", "kernel": "#a1d99b", "write": "#756bb1",
    "write_wait": "#fc9272", "save": "#636363", "load": "#636363",
    "to_device": "#6baed6", "from_device": "#9e9ac8", "device_compute": "#238b45",
}
LABELLED = {"read", "compute", "write", "to_device", "from_device", "device_compute"}


def load(path):
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_sort_index"}
    return events, names, order


def one_step(events, index):
    steps = sorted((e for e in events if e["name"] == "step"), key=lambda e: e["ts"])
    if not steps:
        sys.exit("trace_png: the trace has no step event")
    if not -len(steps) <= index < len(steps):
        sys.exit(f"trace_png: --step {index}: the trace has {len(steps)} steps")
    s = steps[index]
    lo, hi = s["ts"], s["ts"] + s["dur"]
    return s, [e for e in events if e["ts"] >= lo - 1e-3 and e["ts"] + e["dur"] <= hi + 1e-3]


def summary(step, events):
    """What overlapped and what waited: the sums a caption needs, in milliseconds."""
    total = lambda n: sum(e["dur"] for e in events if e["name"] == n) / 1e3
    return {"step_ms": step["dur"] / 1e3, "read_ms": total("read"), "write_ms": total("write"),
            "compute_ms": total("compute"), "read_wait_ms": total("read_wait"),
            "write_wait_ms": total("write_wait"), "check_ms": total("check"),
            "chunks": len({e["args"]["chunk"] for e in events if e["name"] == "compute"})}


def draw(step, events, names, order, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = step["ts"]
    tracks = sorted({e["tid"] for e in events}, key=lambda t: (order.get(t, 0), t))
    row = {t: i for i, t in enumerate(tracks)}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.55 * len(tracks)))
    # Whole-step phases first, so chunk phases draw over them on the step's thread.
    for e in sorted(events, key=lambda e: e["name"] != "step"):
        x, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        y = row[e["tid"]]
        h = 0.8 if e["name"] in ("step",) else 0.6
        ax.barh(y, w, left=x, height=h, color=COLORS.get(e["name"], "#999999"), edgecolor="black", linewidth=0.3)
        if e["name"] in LABELLED and e["args"]["chunk"] >= 0 and w > 0:
            ax.text(x + w / 2, y, str(e["args"]["chunk"]), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([names.get(t, str(t)) for t in tracks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds from the step's start")
    s = summary(step, events)
    ax.set_title(title or (f"one tierstate step: {s['step_ms']:.2f} ms, {s['chunks']} chunks; "
                           f"reads {s['read_ms']:.2f} ms, compute {s['compute_ms']:.2f} ms, "
                           f"waiting for reads {s['read_wait_ms']:.2f} ms"), fontsize=9)
    used = [n for n in COLORS if any(e["name"] == n for e in events)]
    ax.legend(handles=[Patch(color=COLORS[n], label=n) for n in used], fontsize=7, ncol=len(used),
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(tracks) < 4 else -0.12), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return s


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("png")
    p.add_argument("--step", type=int, default=-1)
    p.add_argument("--title", default="")
    a = p.parse_args()
    events, names, order = load(a.trace)
    step, evs = one_step(events, a.step)
    s = draw(step, evs, names, order, a.png, a.title)
    print(json.dumps({"trace_png": a.png, **{k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()}}))


if __name__ == "__main__":
    main()
