#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Runs the char_mlp demo on NvmeFile with --trace and checks the file it writes as a reader
of Chrome's trace-event format would: valid JSON, every event complete ("X") with name, pid,
tid, ts and dur, every track named; one step whose chunks each have one read, one compute and
one write, in that order, reads on the I/O tracks. Leaves nothing behind.

    python3 tests/check_trace.py CHAR_MLP DIR
"""
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict


def main():
    char_mlp, parent = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory(dir=parent) as d:
        path = os.path.join(d, "step.json")
        r = subprocess.run([char_mlp, "--steps", "120", "--path", d, "--trace", path],
                           capture_output=True, text=True, errors="replace", timeout=300)
        if r.returncode != 0:
            sys.exit(f"check_trace: char_mlp failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        if "step 120's timeline" not in r.stdout:
            sys.exit(f"check_trace: char_mlp did not say it wrote the trace:\n{r.stdout}")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        assert os.listdir(d) == ["step.json"], os.listdir(d)  # (the state's scratch file is nameless)
    assert doc["otherData"]["dropped_events"] == 0, doc["otherData"]
    events = doc["traceEvents"]
    named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        for key in ("name", "cat", "pid", "tid", "ts", "dur", "args"):
            assert key in e, (key, e)
        assert e["dur"] >= 0 and e["tid"] in named, e
    steps = [e for e in spans if e["name"] == "step"]
    assert len(steps) == 1, steps
    per_chunk = defaultdict(dict)
    for e in spans:
        if e["name"] in ("read", "compute", "write"):
            assert e["name"] not in per_chunk[e["args"]["chunk"]], ("twice", e)
            per_chunk[e["args"]["chunk"]][e["name"]] = e
    assert len(per_chunk) >= 2, per_chunk.keys()
    for k, ph in per_chunk.items():
        assert set(ph) == {"read", "compute", "write"}, (k, ph)
        r, c, w = ph["read"], ph["compute"], ph["write"]
        assert r["ts"] + r["dur"] <= c["ts"] + 1e-3 and c["ts"] + c["dur"] <= w["ts"] + 1e-3, (k, ph)
        assert r["cat"] == "io" and r["tid"] != c["tid"], (k, ph)
    print(f"check_trace: {len(spans)} events, {len(per_chunk)} chunks, each read, computed and written in order")


if __name__ == "__main__":
    main()
