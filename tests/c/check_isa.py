#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks a dispatched program's or library's disassembly for instructions that a CPU may run
without having them. Each kernel unit (built for one x86-64 level: its archive's name says
which, x86_64_v2 to x86_64_v4_bf16) runs only after the dispatch chose that level for this
CPU (kernels/host/dispatch.hpp), with one exception: a function that several units (or the
program's own code) define alike, such as a standard library function, or a function of a
header without tierstate's ABI namespace (xsimd's), of which the linker keeps one copy for
all of them. So a function defined by several units may use only what the narrowest of them
may: nothing beyond baseline x86-64 if the program's own code (the first archive) defines it,
no AVX-512 if an x86-64-v3 unit does, no BF16, VBMI or IFMA if an x86-64-v4 unit does. (The
build links the narrowest first, so the copy kept is the narrowest unit's; this checks that
it did.) A function local to its unit (static, or a compiler's clone) is that unit's alone.

An instruction's level: EVEX-encoded (AVX-512) 4, or 5 for BF16, VBMI and IFMA; VEX-encoded
(AVX, AVX2, FMA, F16C, BMI), LZCNT, TZCNT and MOVBE 3; anything else 0 (SSE4.2 and POPCNT,
level 2, need no check: no unit is built below it, and the program's own code is baseline).

  check_isa.py [--may-share-none] OBJDUMP NM LIBRARY PROGRAM_ARCHIVE UNIT_ARCHIVE...

Without --may-share-none, a library in which no function is defined by several units fails:
the check then saw nothing to check (for a library whose units are whole optimizers, that
means nm's output was not read). Units that hold only kernels may share nothing."""
import re
import subprocess
import sys

LEVEL3_MNEMONICS = {"andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "mulx", "pdep", "pext", "rorx", "sarx",
                    "shlx", "shrx", "lzcnt", "tzcnt", "movbe"}
LEVEL5_MNEMONICS = {"vpermb", "vpermi2b", "vpermt2b", "vpmultishiftqb", "vcvtne2ps2bf16", "vcvtneps2bf16",
                    "vdpbf16ps", "vpmadd52luq", "vpmadd52huq"}
LEGACY_PREFIXES = {"66", "67", "f2", "f3", "2e", "36", "3e", "26", "64", "65", "f0"}
FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")
INSTRUCTION = re.compile(r"^\s+[0-9a-f]+:\s+((?:[0-9a-f]{2} )+)\s*(\S+)\s*(.*)$")
UNIT_LEVEL = re.compile(r"x86[-_]64[-_]v(\d)([-_]bf16)?")
LEVEL_NAMES = {0: "baseline x86-64", 2: "x86-64-v2", 3: "x86-64-v3", 4: "x86-64-v4", 5: "x86-64-v4-bf16"}


def instruction_level(raw: list[str], mnemonic: str) -> int:
    """The x86-64 level an instruction needs (see above), from its bytes and mnemonic."""
    if mnemonic in LEVEL5_MNEMONICS:
        return 5
    i = 0
    while i < len(raw) and raw[i] in LEGACY_PREFIXES:
        i += 1
    first = raw[i] if i < len(raw) else ""
    if first == "62":
        return 4  # EVEX
    if first in ("c4", "c5") or mnemonic in LEVEL3_MNEMONICS:
        return 3  # VEX (in 64-bit mode c4 and c5 always are), or BMI/LZCNT/MOVBE
    return 0


def unit_level(archive: str) -> int:
    m = UNIT_LEVEL.search(archive.rsplit("/", 1)[-1]) or UNIT_LEVEL.search(archive)
    if not m:
        sys.exit(f"check_isa.py: {archive}: its name does not say its level (x86_64_v2 ... x86_64_v4_bf16)")
    return 5 if m.group(2) else int(m.group(1))


def definers(nm: str, archives: list[tuple[str, int]]) -> dict[str, list[int]]:
    """The levels of the archives that define each global or weak symbol."""
    found: dict[str, list[int]] = {}
    for archive, level in archives:
        out = subprocess.run([nm, "--defined-only", archive], check=True, capture_output=True, text=True).stdout
        names = {parts[2] for parts in (line.split() for line in out.splitlines())
                 if len(parts) == 3 and parts[1] in "TWVuRDBGS"}
        for n in names:
            found.setdefault(n, []).append(level)
    return found


def main() -> int:
    args = sys.argv[1:]
    may_share_none = args[:1] == ["--may-share-none"]
    if may_share_none:
        args = args[1:]
    objdump, nm, library, program, units = args[0], args[1], args[2], args[3], args[4:]
    archives = [(program, 0)] + [(u, unit_level(u)) for u in units]
    defined = definers(nm, archives)
    text = subprocess.run([objdump, "-d", library], check=True, capture_output=True, text=True).stdout
    functions: dict[str, tuple[int, str]] = {}  # name -> the level it needs, and its first instruction of that level
    current = None
    for line in text.splitlines():
        f = FUNCTION.match(line)
        if f:
            current = f.group(1)
            functions.setdefault(current, (0, ""))
            continue
        i = INSTRUCTION.match(line)
        if i and current is not None:
            level = instruction_level(i.group(1).split(), i.group(2))
            if level > functions[current][0]:
                functions[current] = (level, f"{i.group(2)} {i.group(3)}".strip())
    wide_count = 0
    shared = 0
    bad = []
    for name, (needs, first) in functions.items():
        wide_count += needs >= 3
        levels = defined.get(name, [])
        if len(levels) > 1:
            shared += 1
            if needs > min(levels):
                bad.append((name, needs, first, levels))
    if bad:
        demangled = subprocess.run(["c++filt"], input="\n".join(n for n, *_ in bad), capture_output=True,
                                   text=True).stdout.splitlines() or [n for n, *_ in bad]
        for (name, needs, first, levels), pretty in zip(bad, demangled):
            print(f"{pretty}: {first} (needs {LEVEL_NAMES[needs]}); defined by units of "
                  f"{', '.join(LEVEL_NAMES[lv] for lv in sorted(levels))}")
        print(f"{len(bad)} functions shared by several units use instructions beyond the narrowest of them: the "
              "linker kept a wider unit's copy, which a narrower unit's CPU may run (link the program's own objects "
              "first and the units narrowest first)")
        return 1
    print(f"{len(functions)} functions, {shared} of them defined alike by several units and kept once, each within "
          f"what the narrowest of its units may use; {wide_count} use AVX or wider")
    if wide_count == 0:
        print("no function uses AVX or BMI instructions: the wide units' code was not found")
        return 1
    return 0 if shared > 0 or may_share_none else 1  # (none shared: the check saw nothing, and would pass whatever)


if __name__ == "__main__":
    sys.exit(main())
