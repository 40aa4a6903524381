# Test-only stand-in for Conan Center's liburing, in its */system style: the system's
# liburing, found by pkg-config, under Conan Center's names (CMakeDeps' liburing::liburing).
# Debian's liburing-dev has no CMake config of its own. tests/packaging/conan.sh swaps it
# in with [replace_requires].
from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.gnu import PkgConfig
from conan.tools.system.package_manager import Apt

required_conan_version = ">=2.1"


class LiburingSystemConan(ConanFile):
    name = "liburing"
    version = "system"
    description = "The system's liburing (test-only, for tierstate's CI)"
    license = ("GPL-2.0-or-later", "MIT")
    package_type = "shared-library"
    settings = "os", "arch", "compiler", "build_type"

    def layout(self):
        pass

    def package_id(self):
        self.info.clear()

    def validate(self):
        if self.settings.os != "Linux":
            raise ConanInvalidConfiguration("liburing exists on Linux only.")

    def system_requirements(self):
        Apt(self).install(["liburing-dev"], check=True)

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.includedirs = []
        pkg_config = PkgConfig(self, "liburing")
        pkg_config.fill_cpp_info(self.cpp_info, is_system=True)
        # The system's version in the .pc file PkgConfigDeps writes (else "system", which
        # fails a version check such as libtierstate_c's build makes)
        self.cpp_info.set_property("system_package_version", str(pkg_config.version))
        self.cpp_info.set_property("pkg_config_name", "liburing")
