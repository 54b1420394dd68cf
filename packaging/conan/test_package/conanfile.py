# Builds and runs a CMake consumer of the gpukit package just created (conan create runs it). It uses find_package
# (gpukit CONFIG REQUIRED), i.e. gpukit's own package configuration, and exits 0 without a GPU. A package created
# with compiled=True is used through gpukit::compiled.
import os

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, CMakeDeps, CMakeToolchain, cmake_layout


class GpukitTestPackage(ConanFile):
    settings = "os", "arch", "compiler", "build_type"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        CMakeDeps(self).generate()
        toolchain = CMakeToolchain(self)
        toolchain.user_presets_path = False  # write no CMakeUserPresets.json into the source tree
        # A package created with compiled=True is tested through gpukit::compiled.
        toolchain.cache_variables["GPUKIT_TEST_COMPILED"] = bool(self.dependencies["gpukit"].options.compiled)
        toolchain.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def test(self):
        if can_run(self):
            self.run(os.path.join(self.cpp.build.bindir, "test_package"), env="conanrun")
