# Test-only stand-in for Conan Center's xxhash, in its */system style: the system's xxHash,
# found by pkg-config, with Conan Center's names: CMake package xxHash, component libxxhash,
# target xxHash::xxhash. tests/packaging/conan.sh swaps it in with [replace_requires].
from conan import ConanFile
from conan.tools.gnu import PkgConfig
from conan.tools.system.package_manager import Apt

required_conan_version = ">=2.1"


class XxhashSystemConan(ConanFile):
    name = "xxhash"
    version = "system"
    description = "The system's xxHash (test-only, for tierstate's CI)"
    license = "BSD-2-Clause"
    package_type = "shared-library"
    settings = "os", "arch", "compiler", "build_type"

    def layout(self):
        pass

    def package_id(self):
        self.info.clear()

    def system_requirements(self):
        Apt(self).install(["libxxhash-dev"], check=True)

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.includedirs = []
        self.cpp_info.set_property("cmake_file_name", "xxHash")
        self.cpp_info.set_property("cmake_target_name", "xxHash::xxhash")
        self.cpp_info.set_property("pkg_config_name", "libxxhash")
        component = self.cpp_info.components["libxxhash"]
        component.bindirs = []
        pkg_config = PkgConfig(self, "libxxhash")
        pkg_config.fill_cpp_info(component, is_system=True)
        # The system's version in the .pc file PkgConfigDeps writes (else "system", which
        # fails a version check such as libtierstate_c's build makes)
        component.set_property("system_package_version", str(pkg_config.version))
        self.cpp_info.set_property("system_package_version", str(pkg_config.version))
        component.set_property("cmake_target_name", "xxHash::xxhash")
