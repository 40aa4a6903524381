import os

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, get, rmdir
from conan.tools.gnu import PkgConfigDeps
from conan.tools.layout import basic_layout
from conan.tools.scm import Version

required_conan_version = ">=2.1"


class TierstateConan(ConanFile):
    name = "tierstate"
    description = ("Offloaded optimizer state for training: optimizer state kept in pinned host "
                   "memory or NVMe files (io_uring) and updated there with SIMD kernels")
    license = "Apache-2.0"
    url = "https://github.com/conan-io/conan-center-index"
    homepage = "https://github.com/tierstate/tierstate"
    topics = ("optimizer", "offloading", "deep-learning", "io-uring", "simd", "header-only")
    # Header-only, unless c_api: then also libtierstate_c (tierstate/c.h), a shared library (its
    # kernel units must be linked after its own code, narrowest first: src/meson.build); tools
    # adds the program tierstate-plan (bin/). Both are built by src/CMakeLists.txt.
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {"c_api": [True, False], "tools": [True, False]}
    default_options = {"c_api": False, "tools": False}
    no_copy_source = True

    @property
    def _min_cppstd(self):
        return 20

    @property
    def _compilers_minimum_version(self):
        # Designated initializers, concepts and std::span as the headers use them.
        return {
            "gcc": "12",
            "clang": "14",
        }

    @property
    def _builds(self):
        return bool(self.options.c_api or self.options.tools)

    def configure(self):
        if self.options.c_api:
            self.package_type = "shared-library"
        elif self.options.tools:
            self.package_type = "unknown"  # headers and a program

    def layout(self):
        if self._builds:
            cmake_layout(self, src_folder="src")
        else:
            basic_layout(self, src_folder="src")

    def requirements(self):
        # The public headers include xsimd's, liburing's and xxhash's, so a consumer needs
        # their include directories; liburing is also linked by whoever includes tierstate.
        self.requires("xsimd/14.2.0", transitive_headers=True)
        self.requires("liburing/2.15", transitive_headers=True, transitive_libs=True)
        # xxhash is used header-only (XXH_INLINE_ALL): nothing of it is linked.
        self.requires("xxhash/0.8.3", transitive_headers=True, transitive_libs=False)

    def build_requirements(self):
        # src/CMakeLists.txt finds xsimd, liburing and libxxhash with pkg-config.
        if self._builds and not self.conf.get("tools.gnu:pkg_config", check_type=str):
            self.tool_requires("pkgconf/[>=2.2 <3]")

    def package_id(self):
        if not (self.info.options.c_api or self.info.options.tools):
            self.info.clear()
        else:
            # A C library and a program: their C++ is inside (only c.h's functions are exported).
            del self.info.settings.compiler.cppstd

    def validate(self):
        if self.settings.os != "Linux":
            raise ConanInvalidConfiguration(
                f"{self.ref} is Linux only: its NVMe tier is built on io_uring and O_DIRECT.")
        check_min_cppstd(self, self._min_cppstd)
        minimum_version = self._compilers_minimum_version.get(str(self.settings.compiler))
        if minimum_version and Version(self.settings.compiler.version) < minimum_version:
            raise ConanInvalidConfiguration(
                f"{self.ref} needs {self.settings.compiler} {minimum_version} or newer for its "
                f"C++{self._min_cppstd}; this is {self.settings.compiler.version}.")

    def source(self):
        get(self, **self.conan_data["sources"][self.version], strip_root=True)

    def generate(self):
        if self._builds:
            tc = CMakeToolchain(self)
            tc.cache_variables["TIERSTATE_C_API"] = bool(self.options.c_api)
            tc.cache_variables["TIERSTATE_PLAN"] = bool(self.options.tools)
            tc.generate()
            PkgConfigDeps(self).generate()

    def build(self):
        if self._builds:
            cmake = CMake(self)
            cmake.configure(build_script_folder="src")  # libtierstate_c's and tierstate-plan's CMake build
            cmake.build()

    def package(self):
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))
        # Only the headers: the CMake and pkg-config files that the project's own install
        # writes come from CMakeDeps and PkgConfigDeps here.
        for pattern in ("*.hpp", "*.inl"):
            copy(self, os.path.join("tierstate", pattern),
                 os.path.join(self.source_folder, "include"),
                 os.path.join(self.package_folder, "include"))
        # tierstate_add_host_kernels() (README "Portable builds"), a CMake build module
        copy(self, "tierstate-kernels.cmake", os.path.join(self.source_folder, "include", "cmake"),
             os.path.join(self.package_folder, "lib", "cmake"))
        if self._builds:
            CMake(self).install()  # lib/libtierstate_c.so*, include/tierstate/c.h; bin/tierstate-plan
            rmdir(self, os.path.join(self.package_folder, "lib", "pkgconfig"))

    def package_info(self):
        self.cpp_info.set_property("cmake_file_name", "tierstate")
        self.cpp_info.set_property("cmake_build_modules", [os.path.join("lib", "cmake", "tierstate-kernels.cmake")])
        if not self._builds:
            self._headers_info(self.cpp_info)
            self.cpp_info.set_property("cmake_target_name", "tierstate::tierstate")
            return
        # Components, as tierstate's own CMake package has them: the headers, the C library,
        # which needs none of the headers' dependencies, and the program.
        self.cpp_info.set_property("cmake_target_name", "tierstate::tierstate_all")
        self._headers_info(self.cpp_info.components["headers"])
        self.cpp_info.components["headers"].set_property("cmake_target_name", "tierstate::tierstate")
        if self.options.tools:
            plan = self.cpp_info.components["plan"]  # bin/tierstate-plan
            plan.set_property("cmake_target_name", "tierstate::plan")
            plan.bindirs = ["bin"]
            plan.libdirs = []
            plan.includedirs = []
            # On the run (and build) environment's PATH, whatever the requirement's traits (a
            # package of type "unknown", tools without c_api, has no run trait of its own).
            bindir = os.path.join(self.package_folder, "bin")
            self.runenv_info.prepend_path("PATH", bindir)
            self.buildenv_info.prepend_path("PATH", bindir)
        if not self.options.c_api:
            return
        c_api = self.cpp_info.components["c_api"]
        c_api.set_property("cmake_target_name", "tierstate::tierstate_c")
        c_api.set_property("pkg_config_name", "tierstate-c")
        c_api.libs = ["tierstate_c"]
        c_api.bindirs = []
        c_api.requires = ["liburing::liburing"]  # (linked into it: a shared liburing must be found)

    def _headers_info(self, info):
        info.bindirs = []
        info.libdirs = []
        info.set_property("pkg_config_name", "tierstate")
        info.requires = ["xsimd::xsimd", "liburing::liburing", "xxhash::libxxhash"]
        if self.settings.os == "Linux":
            info.system_libs = ["pthread"]
