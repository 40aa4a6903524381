# SPDX-License-Identifier: Apache-2.0
"""The extension: the one a package install built (tierstate_torch._C, see setup.py), or, in
a checkout, compiled on first use with torch.utils.cpp_extension.load.

An installed package never compiles: `pip install --no-build-isolation ./examples/pytorch`
(or a wheel from `pip wheel`) builds the extension once, against the torch it finds, and
records that torch's version; importing it under another torch is refused with a sentence
that says what to do. From a checkout without an install, the extension is built on first
use and cached (by PyTorch, under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions), and
rebuilt when a source or header changes. Either needs g++ >= 12 (C++20), tierstate's
headers, and the headers of xsimd, liburing (and its library) and xxHash:
    apt-get install g++ libxsimd-dev liburing-dev libxxhash-dev pkg-config
and, for compute='device', Thrust (the CUDA toolkit's include/cccl).

Two builds:
- with CUDA (TIERSTATE_TORCH_CUDA=1, or, when it is unset, a visible GPU): tierstate's
  device runtime on the CUDA runtime, the OnDevice kernels compiled by nvcc (CUDA_HOME) for
  TORCH_CUDA_ARCH_LIST (default: the GPUs present, else 9.0);
- without (TIERSTATE_TORCH_CUDA=0, or no GPU): CPU params only. The just-in-time build also
  compiles tierstate's emulated device (its OnDevice kernels on Thrust's CPP backend), for
  tests; a package build only with TIERSTATE_TORCH_EMULATED_DEVICE_BUILD=1.

Environment:
    TIERSTATE_INCLUDE        tierstate's include directory (default: a source distribution's
                             own, this checkout's, else what `pkg-config --cflags tierstate`
                             says)
    TIERSTATE_THRUST_INCLUDE the folder holding thrust/ (default: $CUDA_HOME/include/cccl,
                             /usr/local/cuda/include/cccl, else the system's)
    TIERSTATE_TORCH_CFLAGS   the host optimization flags (default: -O3 -march=native for a
                             just-in-time build, whose host kernels then use the widest SIMD
                             this CPU has; -O2 -march=x86-64 for a package build, whose host
                             kernels are dispatched at run time)
    TIERSTATE_TORCH_DISPATCH=0|1  a package build's host kernels: compiled for each x86-64
                             level (x86-64-v2, v3, v4, v4-bf16) and the widest this CPU has
                             chosen at import (the default on x86-64: the wheel runs on any
                             x86-64 at full speed; TIERSTATE_ARCH=<level> forces one), or
                             (0) for TIERSTATE_TORCH_CFLAGS' -march only
    TIERSTATE_TORCH_VERBOSE=1  print the compiler's command lines
    TIERSTATE_TORCH_DEPS_CFLAGS / TIERSTATE_TORCH_LDFLAGS
                             the flags for liburing and xxHash (default: pkg-config's), for
                             machines without their packages (bench/gpu_prepare.sh)
    TIERSTATE_TORCH_PREBUILT a built extension (.so) to import instead of building
    TIERSTATE_TORCH_JIT=1    in a checkout with an in-place or editable build: build just in
                             time instead of using it
"""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

_CSRC = Path(__file__).resolve().parent / "csrc"
# The translation units of the compositions, one pair (shards_<unit>.cpp for OnHost,
# device_shards_<unit>.cpp or .cu for OnDevice) each: one per Adam rule, one for the rest.
_UNITS = ["adam", "adamw", "adam_amsgrad", "adamw_amsgrad", "sgd_lion_adafactor"]
# The rules with compact compositions (8-bit state, bf16 params without an fp32 master): a
# pair each, shards_<rule>_compact.cpp (OnHost) and device_shards_<rule>_compact.cpp or .cu
# (OnDevice); tierstate_torch refuses the other rules by name.
_COMPACT_RULES = ("adam", "adamw", "lion", "sgd_momentum")


def _pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise RuntimeError(
            f"tierstate_torch: `pkg-config {' '.join(args)}` failed ({detail.strip()}); install "
            "pkg-config, liburing-dev and libxxhash-dev") from e
    return shlex.split(out.stdout)


def _include_flags() -> list[str]:
    given = os.environ.get("TIERSTATE_INCLUDE")
    if given:
        return [f"-I{given}"]
    bundled = _CSRC.parent / "_include"  # (a source distribution's: setup.py's sdist)
    if (bundled / "tierstate" / "optimizer.hpp").is_file():
        return [f"-I{bundled}"]
    checkout = _CSRC.parents[3] / "include"
    if (checkout / "tierstate" / "optimizer.hpp").is_file():
        return [f"-I{checkout}"]
    return _pkg_config("--cflags", "tierstate")


def _thrust_include() -> str | None:
    given = os.environ.get("TIERSTATE_THRUST_INCLUDE")
    if given:
        return given
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for home in filter(None, homes):
        if (Path(home) / "include" / "cccl" / "thrust").is_dir():
            return str(Path(home) / "include" / "cccl")
    if Path("/usr/include/thrust").is_dir():
        return "/usr/include"
    return None


def with_cuda() -> bool:
    """Whether the build is the CUDA one."""
    forced = os.environ.get("TIERSTATE_TORCH_CUDA")
    if forced in ("0", "1"):
        return forced == "1"
    import torch
    return torch.cuda.is_available()


def _deps_cflags() -> list[str]:
    given = os.environ.get("TIERSTATE_TORCH_DEPS_CFLAGS")
    return shlex.split(given) if given is not None else _pkg_config("--cflags", "liburing", "libxxhash")


def _ldflags() -> list[str]:
    given = os.environ.get("TIERSTATE_TORCH_LDFLAGS")
    return shlex.split(given) if given is not None else _pkg_config("--libs", "liburing")


def _import_prebuilt(path: str):
    import importlib.util
    import torch  # noqa: F401  (the extension links against its libraries)

    name = Path(path).name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"tierstate_torch: TIERSTATE_TORCH_PREBUILT={path} is not an importable module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The x86-64 levels of a dispatched build's host kernels (kernels/host/dispatch.hpp), narrowest
# first (the order they are linked in): name, and the flags of host_kernels.cpp's unit.
KERNEL_LEVELS = [
    ("x86-64-v2", ["-march=x86-64-v2", "-DTIERSTATE_HOST_KERNEL_LEVEL=2"]),
    ("x86-64-v3", ["-march=x86-64-v3", "-DTIERSTATE_HOST_KERNEL_LEVEL=3"]),
    ("x86-64-v4", ["-march=x86-64-v4", "-DTIERSTATE_HOST_KERNEL_LEVEL=4", "-Wno-uninitialized", "-Wno-maybe-uninitialized"]),
    ("x86-64-v4-bf16", ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vbmi", "-mavx512ifma",
                        "-DTIERSTATE_HOST_KERNEL_LEVEL=5", "-Wno-uninitialized", "-Wno-maybe-uninitialized"]),
]


def dispatch_default() -> bool:
    """Whether a package build dispatches its host kernels (the default on x86-64:
    TIERSTATE_TORCH_DISPATCH=0 builds them for TIERSTATE_TORCH_CFLAGS' -march instead)."""
    import platform
    forced = os.environ.get("TIERSTATE_TORCH_DISPATCH")
    if forced in ("0", "1"):
        if forced == "1" and platform.machine() not in ("x86_64", "AMD64"):
            raise RuntimeError("tierstate_torch: TIERSTATE_TORCH_DISPATCH=1 is for x86-64 (its levels); this is "
                               f"{platform.machine()}")
        return forced == "1"
    return platform.machine() in ("x86_64", "AMD64")


def extension_spec(cuda: bool, emulated: bool, static_liburing: bool = False, dispatch: bool = False) -> dict:
    """The extension's sources (absolute paths) and flags, for the just-in-time
    build and for setup.py's: with CUDA's device units, or on the CPU with the emulated
    device's units or without them; with the host kernels dispatched at run time (the
    compositions built for plain x86-64, `kernel_units` the flags of host_kernels.cpp's unit
    per level) or built for the -march of TIERSTATE_TORCH_CFLAGS (default native)."""
    common = ["-std=c++20", "-DNDEBUG"] + _include_flags() + _deps_cflags()
    # (a dispatched build: the compositions at -O2, a quarter less compile time than -O3, and
    # their kernels at -O3 in the units)
    default_host = "-O2 -march=x86-64" if dispatch else "-O3 -march=native"
    host = shlex.split(os.environ.get("TIERSTATE_TORCH_CFLAGS", default_host))
    sources = [_CSRC / "bindings.cpp", _CSRC / "rules.cpp", _CSRC / "param_store.cpp"] + [_CSRC / f"shards_{r}.cpp" for r in _UNITS]
    sources += [_CSRC / f"shards_{r}_compact.cpp" for r in _COMPACT_RULES]
    cflags = common + host + ["-Wno-deprecated-declarations"]
    kernel_units: list[tuple[str, list[str]]] = []
    if dispatch:
        cflags.append("-DTIERSTATE_TORCH_DISPATCH")
        kernel_units = [(name, common + ["-O3", "-fPIC", "-g0"] + flags) for name, flags in KERNEL_LEVELS]
    if cuda or emulated:
        cflags.append("-DTIERSTATE_TORCH_DEVICE_PARAMS")  # (shard_impl.hpp)
    cuda_cflags: list[str] = []
    if cuda:
        cflags.append("-DTIERSTATE_ENABLE_CUDA")
        sources += [_CSRC / f"device_shards_{r}.cu" for r in _UNITS]
        sources += [_CSRC / f"device_shards_{r}_compact.cu" for r in _COMPACT_RULES]
        # PyTorch's nvcc flags switch off __half and __nv_bfloat16's operators and
        # conversions, which the device kernels use; switched back on for these files.
        cuda_cflags = common + ["-DTIERSTATE_ENABLE_CUDA", "--expt-relaxed-constexpr", "-O3",
                                "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                                "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
                                "-U__CUDA_NO_BFLOAT16_OPERATORS__"]
        cuda_cflags += [f for h in host for f in ("-Xcompiler", h)]
    else:
        thrust = _thrust_include() if emulated else None
        if thrust is not None:
            cflags += ["-isystem", thrust, "-DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP"]
            sources += [_CSRC / f"device_shards_{r}.cpp" for r in _UNITS]
            sources += [_CSRC / f"device_shards_{r}_compact.cpp" for r in _COMPACT_RULES]
        else:
            sources.append(_CSRC / "no_device_shards.cpp")
    ldflags = _ldflags()
    if static_liburing:
        # A package links liburing statically: a wheel then needs no liburing on the machine.
        # (--exclude-libs: its functions stay inside the extension, not exported from it)
        ldflags = [f for f in ldflags if f != "-luring"] + ["-Wl,-Bstatic", "-luring", "-Wl,-Bdynamic",
                                                             "-Wl,--exclude-libs,liburing.a"]
    return {"sources": sources, "cflags": cflags, "cuda_cflags": cuda_cflags, "ldflags": ldflags,
            "kernel_source": _CSRC / "host_kernels.cpp", "kernel_units": kernel_units}


_REINSTALL = ("pip install --no-build-isolation --no-deps --force-reinstall --no-cache-dir "
              "<tierstate checkout>/examples/pytorch")


def _installed() -> bool:
    """Whether this package has a compiled extension beside it (a package install, or an
    in-place build), which it then uses (TIERSTATE_TORCH_JIT=1: build just in time instead)."""
    import importlib.util
    return os.environ.get("TIERSTATE_TORCH_JIT") != "1" and importlib.util.find_spec("tierstate_torch._C") is not None


def check_torch() -> None:
    """Refuses, with a sentence that says what to do, a torch other than the one the installed
    extension was built against: another major.minor, or a CPU torch (or another CUDA major)
    under the CUDA build. tierstate_torch's __init__ calls it, so the import fails, not the
    first step. An in-place build (setup.py build_ext --inplace) has no record: not checked."""
    if not _installed():
        return
    try:
        from . import _build_info
    except ImportError:
        return
    import torch
    built, running = _build_info.TORCH_VERSION, torch.__version__
    wrong = None
    if built.split("+")[0].split(".")[:2] != running.split("+")[0].split(".")[:2]:
        wrong = f"this is torch {running}"
    elif _build_info.CUDA:
        built_cuda, cuda = getattr(_build_info, "TORCH_CUDA", None), torch.version.cuda
        if cuda is None:
            wrong = f"this torch ({running}) has no CUDA, and tierstate_torch is its CUDA build"
        elif built_cuda is not None and built_cuda.split(".")[0] != cuda.split(".")[0]:
            wrong = f"this torch is built for CUDA {cuda}, and tierstate_torch for CUDA {built_cuda}"
    if wrong is not None:
        raise RuntimeError(
            f"tierstate_torch was built against torch {built} and {wrong}: its compiled extension works with "
            f"the torch it was built for only. Rebuild it under this torch ({_REINSTALL}), or install torch "
            f"{'.'.join(built.split('+')[0].split('.')[:2])}.*")


def _load_installed():
    """The extension a package install built, checked against this torch; None in a checkout
    that has none."""
    if not _installed():
        return None
    check_torch()
    try:
        from . import _C
    except ImportError as e:
        raise RuntimeError(f"tierstate_torch: its compiled extension does not load ({e}); rebuild it under this "
                           f"torch ({_REINSTALL})") from e
    _C.host_kernels()  # chooses the host kernels' level now: a TIERSTATE_ARCH this CPU cannot have is refused here
    return _C


def load_extension():
    prebuilt = os.environ.get("TIERSTATE_TORCH_PREBUILT")
    if prebuilt:
        return _import_prebuilt(prebuilt)
    installed = _load_installed()
    if installed is not None:
        return installed
    if not (_CSRC / "bindings.cpp").is_file():
        if os.environ.get("TIERSTATE_TORCH_JIT") == "1":
            raise RuntimeError("tierstate_torch: TIERSTATE_TORCH_JIT=1 builds just in time from a checkout's "
                               "sources, and this installed package has none: unset it")
        raise RuntimeError("tierstate_torch: this installation has no compiled extension and no sources to build "
                           f"one: reinstall it ({_REINSTALL})")
    from torch.utils.cpp_extension import load

    cuda = with_cuda()
    spec = extension_spec(cuda, emulated=True)
    if cuda:
        import torch
        if "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    return load(
        name="tierstate_torch_C_cuda" if cuda else "tierstate_torch_C",
        sources=[str(s) for s in spec["sources"]],
        extra_cflags=spec["cflags"],
        extra_cuda_cflags=spec["cuda_cflags"] or None,
        extra_ldflags=spec["ldflags"],
        with_cuda=cuda,
        verbose=os.environ.get("TIERSTATE_TORCH_VERBOSE") == "1",
    )
