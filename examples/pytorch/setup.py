# SPDX-License-Identifier: Apache-2.0
"""Builds tierstate_torch's extension ahead of time, so that `import tierstate_torch` never
compiles (pyproject.toml). setuptools with torch's own BuildExtension, because it is the build
PyTorch documents for extensions: it knows torch's include and library paths, its C++ ABI
flag, nvcc and TORCH_CUDA_ARCH_LIST, and compiles in parallel with ninja (MAX_JOBS); the
sources and flags are the just-in-time build's (tierstate_torch/_build.py), so the two cannot
drift.

Environment, besides _build.py's:
    TIERSTATE_TORCH_CUDA=1|0                the CUDA build, or the CPU one (default: CUDA only
                                            where a GPU is visible)
    TIERSTATE_TORCH_EMULATED_DEVICE_BUILD=1 the CPU build with tierstate's emulated device too
                                            (the tests' GPU compositions; 4 more units)
    TIERSTATE_TORCH_SHARED_LIBURING=1       link liburing as a shared library (default:
                                            statically, so that a wheel needs none)
    TIERSTATE_TORCH_DISPATCH=0              the host kernels for TIERSTATE_TORCH_CFLAGS' -march only
                                            (default on x86-64: the compositions for plain
                                            x86-64, the kernels for each level, the widest the
                                            CPU has chosen at import)
"""
import importlib.util
import os
from pathlib import Path

try:
    import torch
except ImportError:
    raise SystemExit("tierstate-torch builds against the torch already installed, without build isolation: "
                     "pip install --no-build-isolation ./examples/pytorch")
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

here = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("_tierstate_torch_build", here / "tierstate_torch" / "_build.py")
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)

cuda = build.with_cuda()
emulated = os.environ.get("TIERSTATE_TORCH_EMULATED_DEVICE_BUILD") == "1" and not cuda
if emulated and build._thrust_include() is None:
    raise SystemExit("TIERSTATE_TORCH_EMULATED_DEVICE_BUILD=1 needs Thrust's headers (TIERSTATE_THRUST_INCLUDE, or "
                     "the CUDA toolkit's include/cccl)")
dispatch = build.dispatch_default()
config = build.extension_spec(cuda, emulated=emulated,
                              static_liburing=os.environ.get("TIERSTATE_TORCH_SHARED_LIBURING") != "1",
                              dispatch=dispatch)
if cuda and "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
extension = (CUDAExtension if cuda else CppExtension)(
    "tierstate_torch._C",
    sources=[str(s.relative_to(here)) for s in config["sources"]],
    # -g0: Python's own CFLAGS ask for -g, which made a 531 MB extension (a 134 MB wheel) and
    # a slower build; a user who wants symbols sets CFLAGS.
    extra_compile_args={"cxx": config["cflags"] + ["-g0"], "nvcc": config["cuda_cflags"]},
    extra_link_args=config["ldflags"],
)
torch_version = torch.__version__


class BuildWithKernelUnits(BuildExtension):
    """torch's BuildExtension, which first compiles the host kernels once per x86-64 level
    (host_kernels.cpp, with each level's flags: setuptools gives one set of flags to all of an
    extension's sources) and links them after the extension's own objects, narrowest first
    (kernels/host/dispatch.hpp says why the order matters)."""

    def finalize_options(self):
        super().finalize_options()
        # setuptools skips an extension whose .so is newer than its .cpp files, which misses a
        # change to tierstate's headers; torch's BuildExtension forces the build with ninja
        # (which then recompiles only what changed) but not without it: forced either way.
        self.force = True

    def build_extensions(self):
        units = config["kernel_units"]
        if units:
            import subprocess
            from concurrent.futures import ThreadPoolExecutor

            from torch.utils.cpp_extension import get_cxx_compiler

            # The compiler ninja compiles the rest with: the kernels' keys are its type names
            # (kernels/host/dispatch.hpp), and another compiler's would not link. Only the
            # level's flags: the environment's CFLAGS could add instructions beyond the level.
            cxx = get_cxx_compiler()

            def compile_unit(unit):
                name, flags = unit
                obj = Path(self.build_temp) / "kernels" / name / "host_kernels.o"
                obj.parent.mkdir(parents=True, exist_ok=True)
                command = [cxx, "-c", str(config["kernel_source"]), "-o", str(obj)] + flags
                print(" ".join(command), flush=True)
                subprocess.run(command, check=True)
                return str(obj)
            # (in parallel, as ninja compiles the rest: MAX_JOBS at a time)
            jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                objects = list(pool.map(compile_unit, units))
            for ext in self.extensions:
                ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extensions()


class BuildPyWithInfo(build_py):
    """Also writes tierstate_torch/_build_info.py into the build: the torch this was built
    against, which the package checks at import (_build.py)."""

    def run(self):
        super().run()
        # An editable install keeps the package in the checkout: the record goes there.
        package = here / "tierstate_torch" if getattr(self, "editable_mode", False) else Path(self.build_lib) / "tierstate_torch"
        package.mkdir(parents=True, exist_ok=True)
        (package / "_build_info.py").write_text(
            f'"""Written by setup.py."""\nTORCH_VERSION = "{torch_version}"\nTORCH_CUDA = {torch.version.cuda!r}\n'
            f'CUDA = {cuda}\nEMULATED_DEVICE = {emulated}\nDISPATCH = {dispatch}\nCFLAGS = {config["cflags"]!r}\n')


class SdistWithHeaders(sdist):
    """A source distribution that builds on its own: tierstate's headers, which a checkout keeps
    at ../../include, go into it as tierstate_torch/_include (_build.py looks there first), and
    the repository's LICENSE beside them."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        bundled = here / "tierstate_torch" / "_include" / "tierstate"  # (an sdist made from an sdist)
        headers = bundled if bundled.is_dir() else here.parents[1] / "include" / "tierstate"
        if not (headers / "optimizer.hpp").is_file():
            raise SystemExit(f"tierstate-torch's sdist takes tierstate's headers from {headers}, which has none")
        shutil.copytree(headers, Path(base_dir) / "tierstate_torch" / "_include" / "tierstate")
        license = here / "LICENSE" if (here / "LICENSE").is_file() else here.parents[1] / "LICENSE"
        shutil.copy(license, Path(base_dir) / "LICENSE")  # (the headers' licence, Apache-2.0)


major, minor = torch_version.split("+")[0].split(".")[:2]
setup(
    ext_modules=[extension],
    cmdclass={"build_ext": BuildWithKernelUnits, "build_py": BuildPyWithInfo, "sdist": SdistWithHeaders},
    install_requires=[f"torch=={major}.{minor}.*"],
)
