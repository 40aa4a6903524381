#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A compile-fail test: compiles FILE with the compiler command after `--` and passes when
the compilation fails and its diagnostics contain every sentence FILE names on its
`// expect: ...` lines (the static_assert sentences users meet, which must not regress into
pages of template errors, or into compiling).

  check.py FILE [--needs-thrust] -- COMPILER ARGS...

A file with a `// needs: thrust` line exits 77 (Meson's skip), saying so, when the command
has no Thrust include (the caller passes --no-thrust). `// flags: ...` lines add compiler flags
after the command's (a later -std wins); a `// max-lines: N` line fails diagnostics longer
than N lines."""
import subprocess
import sys


def main() -> int:
    args = sys.argv[1:]
    if "--" not in args or not args or args[0] == "--":
        print(__doc__)
        return 2
    sep = args.index("--")
    path, opts, command = args[0], args[1:sep], args[sep + 1:]
    text = open(path, encoding="utf-8").read()
    expected = [line.split("// expect:", 1)[1].strip() for line in text.splitlines()
                if line.startswith("// expect:")]
    if not expected:
        print(f"{path}: no `// expect:` line")
        return 2
    if "// needs: thrust" in text and "--no-thrust" in opts:
        print(f"SKIP: {path} needs Thrust's headers, and this build has none")
        return 77
    flags = [f for line in text.splitlines() if line.startswith("// flags:")
             for f in line.split("// flags:", 1)[1].split()]
    max_lines = [int(line.split("// max-lines:", 1)[1]) for line in text.splitlines()
                 if line.startswith("// max-lines:")]
    run = subprocess.run(command + flags + ["-fsyntax-only", path], capture_output=True, text=True,
                         env={"LC_ALL": "C", "PATH": __import__("os").environ.get("PATH", "")})
    out = run.stdout + run.stderr
    if run.returncode == 0:
        print(f"{path} compiled, and it must not: {' / '.join(expected)}")
        return 1
    missing = [e for e in expected if e not in out]
    if missing:
        print(out[-6000:])
        print(f"{path} failed to compile, but its diagnostics lack: {' / '.join(missing)}")
        return 1
    if max_lines and len(out.splitlines()) > max_lines[0]:
        print(out[-6000:])
        print(f"{path}: {len(out.splitlines())} lines of diagnostics, more than {max_lines[0]}")
        return 1
    print(f"{path}: refused, saying: {' / '.join(expected)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
