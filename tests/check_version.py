#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""VERSION is the one place tierstate's version is written; this checks that everything that
states it agrees: the headers' TIERSTATE_VERSION_* macros, meson's project version (passed by
the build), tierstate_torch's __version__, and each package recipe present (vcpkg port,
Conan recipe, pyproject). The installed pkg-config and CMake files take meson's, and
tests/install/run_consumers.sh checks them as installed.

    check_version.py SOURCE_ROOT [MESON_PROJECT_VERSION]
"""
import json
import re
import sys
from pathlib import Path


def main() -> int:
    root = Path(sys.argv[1])
    lines = (root / "VERSION").read_text().splitlines()
    if len(lines) != 1 or not re.fullmatch(r"\d+\.\d+\.\d+", lines[0]):
        print(f"VERSION must be one line MAJOR.MINOR.PATCH, not {lines!r}")
        return 1
    version = lines[0]
    stated: list[tuple[str, str | None]] = []

    config = (root / "include/tierstate/core/config.hpp").read_text()
    def macro(name: str) -> str | None:
        m = re.search(rf"^#define {name} (\S+)$", config, re.M)
        return m.group(1) if m else None
    parts = [macro(f"TIERSTATE_VERSION_{p}") for p in ("MAJOR", "MINOR", "PATCH")]
    stated.append(("include/tierstate/core/config.hpp TIERSTATE_VERSION_MAJOR/MINOR/PATCH",
                   ".".join(p or "?" for p in parts)))
    string = macro("TIERSTATE_VERSION_STRING")
    stated.append(("include/tierstate/core/config.hpp TIERSTATE_VERSION_STRING", string and string.strip('"')))
    if len(sys.argv) > 2:
        stated.append(("meson.build's project version", sys.argv[2]))
    init = (root / "examples/pytorch/tierstate_torch/__init__.py").read_text()
    m = re.search(r'^__version__ = "([^"]*)"', init, re.M)
    stated.append(("examples/pytorch/tierstate_torch/__init__.py __version__", m and m.group(1)))

    # Package recipes, where they exist (in the layouts vcpkg, Conan Center and pip use).
    port = root / "ports/tierstate/vcpkg.json"
    if port.exists():
        manifest = json.loads(port.read_text())
        stated.append(("ports/tierstate/vcpkg.json",
                       manifest.get("version") or manifest.get("version-semver") or manifest.get("version-string")))
    for recipe in ("conanfile.py", "recipes/tierstate/all/conanfile.py"):
        if (root / recipe).exists():
            m = re.search(r'^\s*version\s*=\s*"([^"]*)"', (root / recipe).read_text(), re.M)
            if m:  # (a Conan Center recipe takes its version from conandata.yml and the command line)
                stated.append((recipe, m.group(1)))
    data = root / "recipes/tierstate/all/conandata.yml"
    if data.exists():
        versions = re.findall(r'^  "?([0-9][^":]*)"?:', data.read_text(), re.M)
        stated.append(("recipes/tierstate/all/conandata.yml (its sources)",
                       version if version in versions else ", ".join(versions) or None))
    for pyproject in ("pyproject.toml", "examples/pytorch/pyproject.toml"):
        if (root / pyproject).exists():
            m = re.search(r'^version\s*=\s*"([^"]*)"', (root / pyproject).read_text(), re.M)
            if m:  # (else dynamic)
                stated.append((pyproject, m.group(1)))

    wrong = [(where, what) for where, what in stated if what != version]
    for where, what in stated:
        print(f"{'ok ' if what == version else 'BAD'} {where}: {what}")
    if wrong:
        print(f"VERSION says {version}; these say otherwise (change them to {version}, or VERSION): " +
              "; ".join(f"{where} says {what}" for where, what in wrong))
        return 1
    print(f"every statement of the version agrees with VERSION: {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
