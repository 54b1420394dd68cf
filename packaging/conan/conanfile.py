# Conan 2 recipe for gpukit, kept in the gpukit repository (packaging/conan/). It reuses gpukit's own CMake install:
# consumers load gpukit's gpukitConfig.cmake, so gpukit::gpukit carries CUDA::cudart, Threads::Threads and C++17
# exactly as with a plain `cmake --install`.
#
#   conan profile detect --exist-ok
#   conan create packaging/conan                              # from the repository root; builds and runs test_package/
#   conan create packaging/conan -o "gpukit/*:compiled=True"  # also gpukit::compiled (libgpukit.a)
#
# The CUDA toolkit is not a Conan package. The header-only package (the default) needs none to be created:
# gpukitConfig.cmake finds it on the consumer's machine with find_package(CUDAToolkit) (set CUDAToolkit_ROOT or put
# nvcc on the PATH). With compiled=True the package also holds gpukit::compiled, the optional compiled mode (the
# engines behind gpukit's defaults compiled once; see the README's "Compiled mode"), which is built against the
# toolkit found on the machine that creates the package.
import os
import re

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, load, rmdir

required_conan_version = ">=2.0"

# The recipe lives two directories below the repository root.
_ROOT = os.path.join("..", "..")
# Where gpukit's install puts its CMake package (cmake/gpukitInstall.cmake, GPUKIT_INSTALL_CMAKEDIR).
_CMAKE_DIR = os.path.join("share", "cmake", "gpukit")


class GpukitConan(ConanFile):
    name = "gpukit"
    description = "Header-only C++17 CUDA device and memory management: caching allocator, streams, transfers"
    license = "Apache-2.0"
    url = "https://github.com/gpukit/gpukit"
    homepage = "https://github.com/gpukit/gpukit"
    topics = ("cuda", "gpu", "memory", "allocator", "header-only")
    package_type = "header-library"  # "static-library" with compiled=True (configure)
    settings = "os", "arch", "compiler", "build_type"
    options = {"compiled": [True, False]}
    default_options = {"compiled": False}
    no_copy_source = True

    def set_version(self):
        # include/gpukit/version.hpp is the single source of the version.
        header = load(self, os.path.join(self.recipe_folder, _ROOT, "include", "gpukit", "version.hpp"))
        parts = [re.search(r"#define GPUKIT_VERSION_%s (\d+)" % part, header).group(1)
                 for part in ("MAJOR", "MINOR", "PATCH")]
        self.version = self.version or ".".join(parts)

    def export_sources(self):
        root = os.path.join(self.recipe_folder, _ROOT)
        for pattern in ("CMakeLists.txt", "LICENSE", "cmake/*", "include/*", "src/*"):
            copy(self, pattern, src=root, dst=self.export_sources_folder)

    def validate(self):
        # self.settings, not self.info (cleared in package_id): the consumer's configuration. CUDA's Linux toolkit
        # exists for x86_64 and arm64 only, gpukit loads NVML with dlopen, and its headers need C++17.
        os_, arch = self.settings.os, self.settings.arch
        if os_ != "Linux" or arch not in ("x86_64", "armv8"):
            raise ConanInvalidConfiguration(
                f"gpukit supports Linux on x86_64 or armv8 only (the platforms of CUDA's Linux toolkit): "
                f"not {os_} on {arch}")
        check_min_cppstd(self, 17)

    def configure(self):
        if self.options.compiled:
            self.package_type = "static-library"

    def layout(self):
        cmake_layout(self)

    def generate(self):
        tc = CMakeToolchain(self)
        tc.cache_variables["GPUKIT_BUILD_TESTS"] = False
        tc.cache_variables["GPUKIT_BUILD_EXAMPLES"] = False
        tc.cache_variables["GPUKIT_BUILD_BENCHMARKS"] = False
        tc.cache_variables["GPUKIT_INSTALL"] = True
        tc.cache_variables["GPUKIT_INSTALL_CMAKEDIR"] = _CMAKE_DIR.replace("\\", "/")
        tc.cache_variables["GPUKIT_BUILD_COMPILED"] = bool(self.options.compiled)
        if not self.options.compiled:
            # Nothing is compiled, so the package needs no CUDA toolkit: hiding it proves that (and leaves out
            # gpukit.pc, which would record this machine's toolkit).
            tc.cache_variables["CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit"] = True
        tc.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        if self.options.compiled:
            cmake.build()
            if not os.path.isfile(os.path.join(self.build_folder, "libgpukit.a")):
                raise ConanInvalidConfiguration(
                    "gpukit: compiled=True needs the CUDA toolkit on the machine that creates the package (set "
                    "CUDAToolkit_ROOT or put nvcc on the PATH); none was found, so libgpukit.a was not built")

    def package(self):
        cmake = CMake(self)
        cmake.install()
        copy(self, "LICENSE", src=self.source_folder, dst=os.path.join(self.package_folder, "licenses"))
        rmdir(self, os.path.join(self.package_folder, "share", "doc"))  # the second copy of the license
        rmdir(self, os.path.join(self.package_folder, "res"))
        # gpukit.pc records the paths of this machine's toolkit; package_info describes the package instead.
        rmdir(self, os.path.join(self.package_folder, "lib", "pkgconfig"))

    def package_id(self):
        # Header-only: one package for every configuration. Compiled: one per configuration (the settings).
        if not self.info.options.compiled:
            self.info.clear()

    def package_info(self):
        # CMake consumers load gpukit's own gpukitConfig.cmake (found through builddirs, which CMakeToolchain adds
        # to CMAKE_PREFIX_PATH); CMakeDeps generates nothing for gpukit. That config finds the CUDA toolkit and
        # threads and defines gpukit::gpukit with CUDA::cudart in its link interface.
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.set_property("cmake_file_name", "gpukit")
        self.cpp_info.set_property("cmake_target_name", "gpukit::gpukit")
        # gpukitConfig.cmake defines gpukit::compiled too when the package holds it:
        #   find_package(gpukit CONFIG REQUIRED COMPONENTS compiled) and link gpukit::compiled.
        self.cpp_info.builddirs = [_CMAKE_DIR]
        self.cpp_info.bindirs = []
        # For other generators (PkgConfigDeps, ...): gpukit's include directory, CUDA's include and library
        # directories (absolute: outside the package, which has no lib/) and what gpukitConfig.cmake links.
        # CMakeToolchain puts these directories on CMAKE_INCLUDE_PATH and CMAKE_LIBRARY_PATH too, which FindCUDAToolkit
        # searches for CUDA::cudart before the toolkit it found, unless CUDAToolkit_ROOT is set: a CMake consumer
        # that picks another toolkit by PATH alone sets CUDAToolkit_ROOT or this conf to it.
        self.cpp_info.set_property("pkg_config_name", "gpukit")
        cuda = self._cuda_root()
        if not os.path.isfile(os.path.join(cuda, "include", "cuda_runtime_api.h")):
            self.output.warning(f"no CUDA toolkit in {cuda} (user.gpukit:cuda_root, else CUDA_PATH, CUDA_HOME, "
                                "/usr/local/cuda): generators other than CMake's need -c user.gpukit:cuda_root=<root>")
        cuda_lib = os.path.join(cuda, "lib64")
        if not os.path.isdir(cuda_lib):
            cuda_lib = os.path.join(cuda, "lib")
        self.cpp_info.includedirs = ["include", os.path.join(cuda, "include")]
        if os.path.isdir(os.path.join(cuda, "include", "cccl")):  # the toolkit's CCCL, for the interop headers
            self.cpp_info.includedirs.append(os.path.join(cuda, "include", "cccl"))
        self.cpp_info.libdirs = [cuda_lib]
        self.cpp_info.system_libs = ["cudart", "pthread", "dl"]
        if self.options.compiled:
            # Other generators get the compiled mode whole: the library and the definition that makes the headers
            # use it (gpukit::compiled's usage requirements).
            self.cpp_info.libdirs = ["lib", cuda_lib]
            self.cpp_info.libs = ["gpukit"]
            self.cpp_info.defines = ["GPUKIT_SEPARATE_COMPILATION"]

    def _cuda_root(self):
        # package_info() runs wherever the package is used, so the conf and environment are the consumer's.
        root = (self.conf.get("user.gpukit:cuda_root", check_type=str) or os.environ.get("CUDA_PATH")
                or os.environ.get("CUDA_HOME") or "/usr/local/cuda")
        return os.path.abspath(root)
