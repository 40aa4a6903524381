#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tracing compiled in but off must cost at most 0.5% more instructions per step than tracing
compiled out: runs trace_overhead and trace_overhead_notrace under callgrind (instructions
counted only over the steps), prints one JSON line, and fails above the limit. Exits 77
(Meson's skip) where valgrind is not installed.

    python3 bench/trace_overhead.py TRACE_OVERHEAD TRACE_OVERHEAD_NOTRACE [--limit 0.005]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def instructions(program, args):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "callgrind.out")
        r = subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={out}",
                            program, *args], capture_output=True, text=True, errors="replace", timeout=900)
        if r.returncode != 0:
            sys.exit(f"trace_overhead: {program} under callgrind failed ({r.returncode}):\n{r.stderr[-3000:]}")
        with open(out, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = re.match(r"(?:summary|totals):\s+(\d+)", line)
                if m:
                    return int(m.group(1))
    sys.exit(f"trace_overhead: no instruction total in {program}'s callgrind output")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("traced")
    p.add_argument("untraced")
    p.add_argument("--limit", type=float, default=0.005)
    p.add_argument("--elements", default="100003")
    p.add_argument("--steps", default="4")
    a = p.parse_args()
    if shutil.which("valgrind") is None:
        print("trace_overhead: SKIP: valgrind is not installed (apt-get install valgrind)")
        sys.exit(77)
    args = ["--elements", a.elements, "--steps", a.steps]
    on = instructions(a.traced, args)
    off = instructions(a.untraced, args)
    ratio = on / off
    print(json.dumps({"bench": "trace_overhead", "tool": "callgrind", "elements": int(a.elements),
                      "steps": int(a.steps) * 2, "instructions_compiled_in_off": on,
                      "instructions_compiled_out": off, "ratio": round(ratio, 6), "limit": 1 + a.limit}))
    if ratio > 1 + a.limit:
        sys.exit(f"trace_overhead: tracing compiled in but off runs {100 * (ratio - 1):.3f}% more instructions "
                 f"than compiled out (limit {100 * a.limit:.1f}%)")


if __name__ == "__main__":
    main()
