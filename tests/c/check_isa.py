#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks libtierstate_c's disassembly for instructions that a CPU without AVX cannot run,
outside the kernels built for AVX or wider (src/meson.build). Each kernel unit's code runs
only after the library chose that unit for this CPU (src/c_api.cpp), with one exception: a
function that several units (or the dispatching unit) define alike, such as a standard
library function or an inline function of a header without tierstate's ABI namespace, of
which the linker keeps one copy for all of them. So every function that uses AVX, AVX2,
AVX-512, FMA, BMI, LZCNT or MOVBE must be defined (global or weak) in one unit only; a
function local to its unit (static, or a compiler's clone) is that unit's alone.

  check_isa.py [--may-share-none] OBJDUMP NM LIBRARY UNIT_ARCHIVE...   (the dispatching unit's archive first)

Without --may-share-none, a program in which no function is defined by several units fails:
the check then saw nothing to check (for a library whose units are whole optimizers, that
means nm's output was not read). Units that hold only kernels may share nothing."""
import re
import subprocess
import sys

WIDE_MNEMONICS = {"andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "mulx", "pdep", "pext", "rorx", "sarx",
                  "shlx", "shrx", "lzcnt", "tzcnt", "movbe"}
WIDE_REGISTER = re.compile(r"%(?:ymm|zmm)\d+|%k[0-7]\b")
FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")
INSTRUCTION = re.compile(r"^\s+[0-9a-f]+:\s+(\S+)\s*(.*)$")


def wide(mnemonic: str, operands: str) -> bool:
    if mnemonic.startswith("v") and mnemonic not in ("verr", "verw"):
        return True  # VEX or EVEX encoded: AVX and later
    return mnemonic in WIDE_MNEMONICS or WIDE_REGISTER.search(operands) is not None


def shared_definitions(nm: str, archives: list[str]) -> dict[str, int]:
    """How many of the archives define each global or weak symbol."""
    count: dict[str, int] = {}
    for archive in archives:
        out = subprocess.run([nm, "--defined-only", archive], check=True, capture_output=True, text=True).stdout
        names = {parts[2] for parts in (line.split() for line in out.splitlines())
                 if len(parts) == 3 and parts[1] in "TWVuRDBGS"}
        for n in names:
            count[n] = count.get(n, 0) + 1
    return count


def main() -> int:
    args = sys.argv[1:]
    may_share_none = args[:1] == ["--may-share-none"]
    if may_share_none:
        args = args[1:]
    objdump, nm, library, archives = args[0], args[1], args[2], args[3:]
    defined = shared_definitions(nm, archives)
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", library], check=True, capture_output=True,
                          text=True).stdout
    functions: dict[str, str] = {}  # name -> the first wide instruction in it ("" when none)
    current = None
    for line in text.splitlines():
        f = FUNCTION.match(line)
        if f:
            current = f.group(1)
            functions.setdefault(current, "")
            continue
        i = INSTRUCTION.match(line)
        if i and current is not None and not functions[current] and wide(i.group(1), i.group(2)):
            functions[current] = f"{i.group(1)} {i.group(2)}".strip()
    wide_count = 0
    bad = []
    for name, first in functions.items():
        if not first:
            continue
        wide_count += 1
        if defined.get(name, 0) > 1:
            bad.append((name, first))
    if bad:
        demangled = subprocess.run(["c++filt"], input="\n".join(n for n, _ in bad), capture_output=True,
                                   text=True).stdout.splitlines() or [n for n, _ in bad]
        for (name, first), pretty in zip(bad, demangled):
            print(f"{pretty}: {first}; defined by {defined[name]} units")
        print(f"{len(bad)} functions shared by several units use AVX or BMI instructions: the linker kept a wide "
              "unit's copy, which a CPU without AVX may run (src/meson.build says why the order matters)")
        return 1
    shared = sum(1 for n in functions if defined.get(n, 0) > 1)
    print(f"{len(functions)} functions, {shared} of them defined alike by several units and kept once: none of "
          f"these uses AVX or BMI instructions; the {wide_count} that do are each one unit's own")
    if wide_count == 0:
        print("no function uses AVX or BMI instructions: the wide units' code was not found")
        return 1
    return 0 if shared > 0 or may_share_none else 1  # (none shared: the check saw nothing, and would pass whatever)


if __name__ == "__main__":
    sys.exit(main())
