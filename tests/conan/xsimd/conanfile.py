# Test-only stand-in for Conan Center's xsimd, in its */system style: the system's xsimd,
# found by pkg-config, under the names Conan Center's recipe gives (CMake target `xsimd`).
# tests/packaging/conan.sh swaps it in with [replace_requires], as nothing can be downloaded.
from conan import ConanFile
from conan.tools.gnu import PkgConfig
from conan.tools.system.package_manager import Apt

required_conan_version = ">=2.1"


class XsimdSystemConan(ConanFile):
    name = "xsimd"
    version = "system"
    description = "The system's xsimd (test-only, for tierstate's CI)"
    license = "BSD-3-Clause"
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"

    def layout(self):
        pass

    def package_id(self):
        self.info.clear()

    def system_requirements(self):
        Apt(self).install(["libxsimd-dev"], check=True)

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.includedirs = []
        pkg_config = PkgConfig(self, "xsimd")
        pkg_config.fill_cpp_info(self.cpp_info, is_system=True)
        # The system's version in the .pc file PkgConfigDeps writes (else "system", which
        # fails a version check such as libtierstate_c's build makes)
        self.cpp_info.set_property("system_package_version", str(pkg_config.version))
        self.cpp_info.set_property("cmake_file_name", "xsimd")
        self.cpp_info.set_property("cmake_target_name", "xsimd")
        self.cpp_info.set_property("pkg_config_name", "xsimd")
