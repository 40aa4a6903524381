#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes dynamic8_golden.inc: the 8-bit blockwise codecs (codecs/dynamic8.hpp) written again
in Python, and optimizers whose moments are stored with them.

    python3 tests/golden/make_golden_dynamic8.py > tests/golden/dynamic8_golden.inc

The maps are bitsandbytes' create_dynamic_map(signed) for 8 bits and 7 decades, computed in
torch's float32 steps as bitsandbytes computes them. Encoding is a brute-force nearest search over
all 256 values (ties to the smaller magnitude), not the library's bucket table or binary search.

The optimizer cases run torch.optim.AdamW and SGD, and Lion written in torch as
make_golden_sgd_lion.py does, on float32 params; after each step the moments are replaced by
what their 8-bit blocks decode to: the semantics of an 8-bit optimizer (the step uses the
moments in float32; only what is kept between steps is 8-bit).
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import grad_value, init_value, lr_at  # noqa: E402
from make_golden_sgd_lion import lion_step  # noqa: E402

BLOCK = 256


def make_map(signed):
    ladder = [0.0]
    for i in range(7):
        count = 2**i if signed else 2 ** (i + 1)
        bounds = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        ladder += ((10 ** (i - 6)) * ((bounds[:-1] + bounds[1:]) / 2.0)).tolist()
    ladder.append(1.0)
    if signed:
        values = [-x for x in reversed(ladder[1:128])] + ladder  # 127 negatives, 0, ..., 1.0
    else:
        values = ladder
    assert len(values) == 256
    return np.array(values, dtype=np.float32)


MAPS = {True: make_map(True), False: make_map(False)}


def nearest(values, x):
    """The code of the value nearest x; of two as near, the one of smaller magnitude."""
    d = np.abs(values.astype(np.float64) - float(x))
    best = np.flatnonzero(d == d.min())
    return int(min(best, key=lambda c: abs(float(values[c]))))


def encode(signed, v):
    """One block of up to 256 float32 values: (scale, codes of the first len(v)). The scale is
    the largest magnitude, negative (signed map) where that is a negative value's alone."""
    v = np.asarray(v, dtype=np.float32)
    hi = max(np.float32(0), np.max(v)) if len(v) else np.float32(0)
    lo = min(np.float32(0), np.min(v)) if len(v) else np.float32(0)
    scale = (lo if -lo > hi else hi) if signed else max(hi, -lo)
    if np.isnan(v).any():
        scale = np.float32("nan")
    values = MAPS[signed]
    zero = int(np.flatnonzero(values == 0)[0])
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.float32(1) / np.float32(scale)
    if not (abs(inverse) > 0 and np.isfinite(inverse)):  # zero, non-finite or subnormal scale
        return scale, [zero] * len(v)
    return scale, [nearest(values, np.float32(x) * inverse) for x in v]


def decode(signed, scale, codes):
    return MAPS[signed][np.array(codes, dtype=np.int64)] * np.float32(scale) + np.float32(0)


def store(signed, t):
    """A tensor's values as its blocks keep them."""
    flat = t.detach().numpy().astype(np.float32)
    out = np.empty_like(flat)
    for b in range(0, len(flat), BLOCK):
        scale, codes = encode(signed, flat[b : b + BLOCK])
        out[b : b + BLOCK] = decode(signed, scale, codes)
    return torch.from_numpy(out)


def hexes(a):
    """float32 values as the shortest decimals that read back to the same floats."""
    return ", ".join(np.format_float_positional(x, unique=True, trim="0") + "f"
                     if x == 0 or 1e-4 <= abs(x) < 1e4 else np.format_float_scientific(x, unique=True) + "f"
                     for x in np.asarray(a, dtype=np.float32))


SIZES = [1, 7, 257, 600]
STEPS = 30
# name, rule, lr_max, (beta1, beta2), eps, weight_decay
CASES = [
    ("adamw8", "adamw", 1e-2, (0.9, 0.999), 1e-8, 0.01),
    ("adamw8_fast_v", "adamw", 3e-3, (0.8, 0.95), 1e-6, 0.0),
    ("sgd8_momentum", "sgd", 1e-2, (0.9, 0.0), 0.0, 0.01),
    ("lion8", "lion", 1e-3, (0.9, 0.99), 0.0, 0.1),
]


def run(rule, lr_max, betas, eps, wd, base, n):
    p = torch.tensor([init_value(base + i) for i in range(n)], dtype=torch.float32, requires_grad=True)
    if rule == "adamw":
        opt = torch.optim.AdamW([p], lr=lr_max, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    elif rule == "sgd":
        opt = torch.optim.SGD([p], lr=lr_max, momentum=betas[0], weight_decay=wd, foreach=False)
    m = torch.zeros(n)
    for t in range(1, STEPS + 1):
        lr = lr_at(lr_max, t, STEPS)
        g = torch.tensor([grad_value(base + i, t) for i in range(n)], dtype=torch.float32)
        if rule == "lion":
            with torch.no_grad():
                lion_step(p, m, g, lr, betas[0], betas[1], wd, False)
            m.copy_(store(True, m))
            continue
        for group in opt.param_groups:
            group["lr"] = lr
        p.grad = g
        opt.step()
        st = opt.state[p]
        if rule == "adamw":
            st["exp_avg"].copy_(store(True, st["exp_avg"]))
            st["exp_avg_sq"].copy_(store(False, st["exp_avg_sq"]))
        else:
            st["momentum_buffer"].copy_(store(True, st["momentum_buffer"]))
    st = opt.state[p] if rule != "lion" else {"m": m}
    slots = [st["exp_avg"], st["exp_avg_sq"]] if rule == "adamw" else [st["momentum_buffer"] if rule == "sgd" else m]
    return p.detach(), slots


def main():
    torch.set_num_threads(1)
    out = sys.stdout
    out.write("// Generated by tests/golden/make_golden_dynamic8.py with torch %s: do not edit.\n" % torch.__version__)
    out.write("// The signed and unsigned maps.\n")
    out.write("inline std::vector<float> const golden_signed_map = {%s};\n" % hexes(MAPS[True]))
    out.write("inline std::vector<float> const golden_unsigned_map = {%s};\n" % hexes(MAPS[False]))
    # Blocks to encode: awkward values and lengths; the inputs are init_value/grad_value.
    out.write("// {signed, n, factor, scale, codes}: block i's inputs are grad_value(i, 7) * factor.\n")
    out.write("inline std::vector<golden_block> const golden_blocks = {\n")
    for signed in (True, False):
        for n, factor in ((1, 1.0), (7, 1e-3), (255, 1.0), (256, 3e-7), (256, -1e4), (100, 0.0)):
            v = [np.float32(grad_value(i, 7) * factor) for i in range(n)]
            if not signed:
                v = [np.float32(abs(x)) for x in v]
            scale, codes = encode(signed, v)
            out.write("{%s, %d, %r, %sf, {%s}},\n" % ("true" if signed else "false", n, factor,
                                                    float.hex(float(scale)), ", ".join(map(str, codes))))
    out.write("};\n")
    out.write("// {name, rule, lr_max, beta1, beta2, eps, weight_decay, steps, sizes, params, slots}\n")
    out.write("inline std::vector<golden_run> const golden_runs = {\n")
    for name, rule, lr_max, betas, eps, wd in CASES:
        params, slots = [], [[] for _ in range(2 if rule == "adamw" else 1)]
        base = 0
        for n in SIZES:
            p, s = run(rule, lr_max, betas, eps, wd, base, n)
            params.append(p)
            for j, x in enumerate(s):
                slots[j].append(x)
            base += n
        out.write('{"%s", "%s", %r, %r, %r, %r, %r, %d, {%s},\n' % (
            name, rule, lr_max, betas[0], betas[1], eps, wd, STEPS, ", ".join(map(str, SIZES))))
        out.write(" {%s},\n" % hexes(torch.cat(params)))
        out.write(" {%s}},\n" % ", ".join("{%s}" % hexes(torch.cat(s)) for s in slots))
    out.write("};\n")


if __name__ == "__main__":
    main()
