#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fails when tests/meson.build's header list and the headers under include/ differ."""
import pathlib
import sys

root = pathlib.Path(sys.argv[1])
listed = set(sys.argv[2:])
found = {str(p.relative_to(root)) for p in root.rglob("*.hpp")}
missing = sorted(found - listed)
stale = sorted(listed - found)
for h in missing:
    print(f"header {h} is not in tests/meson.build's `headers` list: add it so it is compiled alone")
for h in stale:
    print(f"tests/meson.build lists {h}, which does not exist")
print(f"{len(found)} headers, {len(listed)} listed")
sys.exit(1 if missing or stale else 0)
