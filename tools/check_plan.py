#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tierstate-plan's model against the arithmetic written out here, independently: for given
bandwidths (no probes) and several jobs, every composition's bytes and predicted step, and
what fits; then the refusals (an unknown format, a missing value, --params missing) exit 2
naming what was wrong.
    check_plan.py TIERSTATE_PLAN"""
import json
import math
import subprocess
import sys

tool = sys.argv[1]
GIB = 1 << 30


def run(*args, ok=True):
    p = subprocess.run([tool, *args], capture_output=True, text=True, timeout=120)
    if ok and p.returncode != 0:
        sys.exit(f"tierstate-plan {' '.join(args)}: exit {p.returncode}: {p.stderr}")
    return p


def expect(what, got, want, rel=1e-3):
    if want is None or (isinstance(want, float) and math.isnan(want)):
        ok = got is None
    elif isinstance(want, (bool, str)):
        ok = got == want
    else:
        ok = got is not None and abs(got - want) <= rel * abs(want) + 1e-12
    if not ok:
        sys.exit(f"{what}: tierstate-plan says {got!r}, the arithmetic {want!r}")


SLOTS = {"adamw": 2, "adam": 2, "adam_amsgrad": 3, "sgd": 0, "sgd_momentum": 1, "lion": 1}
cases = [
    dict(params=1e9, param="bf16", state="fp32", master="fp32", rule="adamw", gpu=24 * GIB, host=128 * GIB, disk=None),
    dict(params=13e9, param="bf16", state="fp32", master="fp32", rule="adamw", gpu=24 * GIB, host=128 * GIB, disk=3.0),
    dict(params=70e9, param="bf16", state="int8", master="kahan", rule="lion", gpu=80 * GIB, host=512 * GIB, disk=6.5),
    dict(params=3e8, param="fp32", state="bf16", master="fp32", rule="sgd_momentum", gpu=8 * GIB, host=16 * GIB, disk=1.0),
]
host_gb_s, pcie_gb_s, chunk, depth, layers = 40.0, 20.0, 1 << 20, 2, 24
for c in cases:
    args = ["--params", repr(c["params"]), "--param", c["param"], "--state", c["state"], "--master", c["master"],
            "--rule", c["rule"], "--gpu-memory", str(c["gpu"]), "--host-memory", str(c["host"]), "--no-probe",
            "--host-gb-s", str(host_gb_s), "--pcie-gb-s", str(pcie_gb_s), "--chunk-elements", str(chunk),
            "--layers", str(layers), "--json"]
    free = 2e12
    if c["disk"]:
        args += ["--nvme", "/tmp", "--nvme-capacity", str(free), "--disk-gb-s", str(c["disk"])]
    rows = [json.loads(line) for line in run(*args).stdout.splitlines()]
    n = c["params"]
    p = 4 if c["param"] == "fp32" else 2
    master = 0 if c["param"] == "fp32" or c["master"] == "none" else (2 if c["master"] == "kahan" else 4)
    slot = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / 256}[c["state"]]
    s = master + SLOTS[c["rule"]] * slot
    own_master = c["param"] == "fp32" or c["master"] != "fp32"  # the param is read too, and comes down over PCIe
    traffic = 2 * s + 2 * p + (p if own_master else 0)
    staging = (depth + 2) * chunk * s
    rings = (depth + 2) * chunk * 2 * p
    compute = n * traffic / (host_gb_s * 1e9)
    pcie = n * (3 if own_master else 2) * p / (pcie_gb_s * 1e9)
    window = min(2 / layers, 1) * n * 2 * p

    def disk(b):
        return b / (c["disk"] * 1e9) if c["disk"] else float("nan")

    want = [
        dict(gpu=n * (2 * p + s), host=0, nvme=0, memlock=0, step=float("nan")),
        dict(gpu=n * 2 * p, host=n * s + rings, nvme=0, memlock=0, step=max(compute, pcie)),
        dict(gpu=n * 2 * p, host=staging + rings, nvme=n * s, memlock=staging,
             step=max(compute, pcie, disk(n * 2 * s)) if c["disk"] else float("nan")),
        dict(gpu=window, host=staging + rings + window, nvme=n * (s + p), memlock=staging,
             step=max(compute, pcie, disk(n * (2 * s + 2 * p))) if c["disk"] else float("nan")),
    ]
    if len(rows) != 4:
        sys.exit(f"{len(rows)} compositions, not 4: {rows}")
    for r, w in zip(rows, want):
        tag = f"{c['params']:.3g} {c['rule']} {c['state']}, {r['plan']}"
        expect(tag + ": GPU bytes", r["gpu_bytes"], w["gpu"])
        expect(tag + ": host bytes", r["host_bytes"], w["host"])
        expect(tag + ": NVMe bytes", r["nvme_bytes"], w["nvme"])
        expect(tag + ": memlock bytes", r["memlock_bytes"], w["memlock"])
        expect(tag + ": step seconds", r["step_seconds"], w["step"])
        fits = w["gpu"] <= 0.9 * c["gpu"] and w["host"] <= 0.9 * c["host"] and \
            (w["nvme"] == 0 or (c["disk"] is not None and w["nvme"] <= 0.9 * free))
        expect(tag + ": fits", r["fits"], fits)
    print(f"{c['params']:.3g} params, {c['rule']}, {c['state']} state: the 4 compositions agree "
          f"(fits: {[r['fits'] for r in rows]})")

for args, words in [(["--params", "7B", "--state", "fp8", "--no-probe"], ["state", "fp8", "int8"]),
                    (["--params", "7B", "--rule", "adagrad", "--no-probe"], ["rule", "adagrad"]),
                    (["--params", "-3", "--no-probe"], ["--params", "positive"]),
                    (["--params"], ["missing value after --params"]),
                    (["--no-probe"], ["--params N is needed"]),
                    (["--params", "7B", "--frobnicate", "1"], ["unknown option --frobnicate"])]:
    p = run(*args, ok=False)
    if p.returncode != 2 or not all(w in p.stderr for w in words):
        sys.exit(f"tierstate-plan {' '.join(args)}: exit {p.returncode}, stderr {p.stderr!r}: "
                 f"wanted exit 2 and {words}")
    print(f"refused, exit 2: {p.stderr.splitlines()[0]}")
print("tierstate-plan: the model and the refusals as written")
