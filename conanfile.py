# The development recipe: packages this checkout (exports_sources) for CI and for
# `conan create . --test-folder recipes/tierstate/all/test_package`. Everything but where the
# sources and the version come from is the Conan Center recipe's, which it subclasses, so
# the two cannot drift apart; the exported recipe carries that file along.
import importlib.util
import os

from conan.tools.files import load
from conan.tools.cmake import cmake_layout
from conan.tools.layout import basic_layout

required_conan_version = ">=2.1"


def _conan_center_recipe():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "recipes", "tierstate", "all", "conanfile.py")
    spec = importlib.util.spec_from_file_location("_tierstate_conan_center_recipe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TierstateConan


class TierstateDevelopmentConan(_conan_center_recipe()):
    exports = "recipes/tierstate/all/conanfile.py"
    exports_sources = ("include/tierstate/*", "include/cmake/tierstate-kernels.cmake", "src/*",
                       "tools/tierstate_plan.cpp", "LICENSE", "VERSION")

    def set_version(self):
        # VERSION is the one place the version is written (tests/check_version.py).
        self.version = load(self, os.path.join(self.recipe_folder, "VERSION")).strip()

    def layout(self):
        # The sources are this checkout, so no src/ subfolder (`conan export-pkg .` works).
        if self.options.c_api:
            cmake_layout(self)
        else:
            basic_layout(self)

    def source(self):
        pass  # exports_sources brought them
