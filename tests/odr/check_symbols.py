#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""No tierstate weak symbol has two bodies.

  check_symbols.py NM OBJDUMP LIBRARY...

Each LIBRARY is one ODR translation unit (tests/odr/odr_tu.cpp) built with its own flags.
A weak symbol (an inline function, a template instantiation, an inline variable) defined in
two of them is one name the linker resolves to one body; where the bodies differ, one
translation unit runs code compiled for the other's flags (AVX-512 in a baseline caller, or
F16C where there is none). tierstate puts every definition in an inline namespace named
after the configuration (core/config.hpp), so no tierstate name may be shared between
translation units built with different flags with a different body. Symbols of the tests'
own namespace (tierstate::test) are not the library's and are left out.

Two translation units whose flags give the same configuration name (say -march=native and
-march=x86-64-v3 on a CPU whose extensions are x86-64-v3's) share their names by design: they
may differ in tuning, never in the instructions they may use. Only names shared between
translation units of different configurations are compared.

Bodies are compared by size (nm -S) and, where the sizes agree, by their disassembly with
relocations (objdump -dr), which is what the linker would make of them."""
import collections
import re
import subprocess
import sys

LINE = re.compile(r"^(?P<where>.*?):(?P<addr>[0-9a-f]+) (?P<size>[0-9a-f]+) (?P<type>[A-Za-z]) (?P<name>\S+)$")
WEAK = {"W", "V", "u"}


def symbols(nm: str, library: str) -> dict[str, int]:
    out = subprocess.run([nm, "-A", "-S", "--defined-only", library], capture_output=True, text=True, check=True)
    found: dict[str, int] = {}
    for line in out.stdout.splitlines():
        m = LINE.match(line)
        if m and m["type"] in WEAK and "9tierstate" in m["name"]:
            found[m["name"]] = int(m["size"], 16)
    return found


def demangle(names: list[str]) -> dict[str, str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    plain = out.stdout.splitlines() if out.returncode == 0 else names
    return dict(zip(names, plain)) if len(plain) == len(names) else {n: n for n in names}


def body(objdump: str, library: str, name: str) -> list[str]:
    out = subprocess.run([objdump, "-dr", "--no-show-raw-insn", "--no-addresses", f"--disassemble={name}", library],
                         capture_output=True, text=True)
    lines, inside = [], False
    for line in out.stdout.splitlines():
        if line.startswith("<") and line.endswith(">:"):
            inside = line == f"<{name}>:"
            continue
        if inside and line.strip():
            lines.append(line.strip())
    return lines


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__)
        return 2
    nm, objdump, libraries = sys.argv[1], sys.argv[2], sys.argv[3:]
    table = {lib: symbols(nm, lib) for lib in libraries}
    where: dict[str, list[str]] = collections.defaultdict(list)
    for lib, syms in table.items():
        for name in syms:
            where[name].append(lib)
    # Each translation unit's configuration: the inline namespace its tierstate names carry.
    config: dict[str, str] = {}
    for lib, syms in table.items():
        names = demangle(list(syms)[:200])
        seen = collections.Counter(m.group(0) for n in names.values()
                                   for m in [re.search(r"tierstate::(abi_(?:host|cuda)_\w+)::", n)] if m)
        config[lib] = seen.most_common(1)[0][0] if seen else f"(none: {lib})"
    for lib in libraries:
        print(f"{lib.rsplit('/', 1)[-1]}: {config[lib]}")
    shared = [n for n, libs in where.items() if len({config[lib] for lib in libs}) > 1]
    plain = demangle(shared)
    shared = [n for n in shared if not plain[n].startswith("tierstate::test::")]
    two_bodies = []
    for name in sorted(shared):
        # One translation unit per configuration: within one, the bodies may differ in tuning.
        libs = list({config[lib]: lib for lib in where[name]}.values())
        sizes = {table[lib][name] for lib in libs}
        if len(sizes) > 1:
            two_bodies.append((name, libs, f"sizes {sorted(sizes)}"))
            continue
        bodies = {tuple(body(objdump, lib, name)) for lib in libs}
        if len(bodies) > 1:
            two_bodies.append((name, libs, "same size, different instructions"))
    counts = ", ".join(f"{lib.rsplit('/', 1)[-1]}: {len(s)}" for lib, s in table.items())
    print(f"tierstate weak symbols per translation unit: {counts}; shared across configurations: {len(shared)}")
    for name, libs, why in two_bodies[:40]:
        print(f"TWO BODIES ({why}): {plain[name]}\n    in {', '.join(l.rsplit('/', 1)[-1] for l in libs)}")
    if len(two_bodies) > 40:
        print(f"... and {len(two_bodies) - 40} more")
    if two_bodies:
        print(f"{len(two_bodies)} tierstate weak symbols have two bodies in one program")
        return 1
    if not any(table.values()):
        print("no tierstate weak symbol found at all: the check would see nothing")
        return 1
    if len(set(config.values())) < 2:
        print("every translation unit has the same configuration: nothing to compare")
        return 1
    print("no tierstate weak symbol has two bodies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
