import os

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, cmake_layout


class TestPackageConan(ConanFile):
    settings = "os", "arch", "compiler", "build_type"
    generators = "CMakeDeps", "CMakeToolchain", "VirtualRunEnv"
    test_type = "explicit"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        cmake_layout(self)

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def test(self):
        if can_run(self):
            bin_path = os.path.join(self.cpp.build.bindir, "test_package")
            self.run(bin_path, env="conanrun")
            tested = self.dependencies[self.tested_reference_str]
            if tested.options.c_api:
                self.run(os.path.join(self.cpp.build.bindir, "test_package_c"), env="conanrun")
            if tested.options.tools:  # by its name: the run environment's PATH finds it
                self.run("tierstate-plan --params 13B --no-probe", env="conanrun")
