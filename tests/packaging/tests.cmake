# Packaging tests (ctest label `packaging`): every route by which users consume gpukit is proven by configuring,
# building and running a separate consumer project:
#   packaging.install            cmake --install into a prefix, and checks of the installed tree (fixture); the same
#                                install without a CUDA toolkit gives the same CMake package
#   packaging.find_package       find_package(gpukit CONFIG REQUIRED) on a moved copy of that prefix; version checks
#   packaging.pkg_config         pkg-config --cflags --libs gpukit, on a moved copy of that prefix
#   packaging.add_subdirectory   add_subdirectory(gpukit) in a parent that exports a target linking gpukit::gpukit;
#                                a parent's hidden visibility preset and unity builds leave gpukit::compiled alone
#   packaging.fetchcontent       FetchContent of this checkout
#   packaging.conan              conan create packaging/conan (and its test_package), in a private CONAN_HOME; refused
#                                configurations; a PkgConfigDeps consumer
#   packaging.vcpkg_files        the vcpkg ports' files parse, agree with the install layout, and leave the expected
#                                package when run with stand-ins for vcpkg's functions (vcpkg is not run)
#   packaging.vcpkg_release      packaging/release.sh --check: the registry port's SHA512 is that of its release
#   packaging.release            packaging/release.sh cuts a release in a scratch repository and refuses bad ones
# They take a while and need pkg-config and Conan 2 (.ci/install-deps installs both), so they are registered only
# with -DGPUKIT_TEST_PACKAGING=ON (tests/run_all.sh turns it on in its gcc-cxx17 configuration). A missing tool makes
# its test fail, never pass. The drivers are the cmake -P scripts in tests/packaging/; all their files go under
# <build>/tests/packaging/<test>/.
option(GPUKIT_TEST_PACKAGING "Register the packaging tests (ctest label packaging; need pkg-config and Conan 2)" OFF)
if(NOT GPUKIT_TEST_PACKAGING)
  return()
endif()

set(gpukit_packaging_drivers "${CMAKE_CURRENT_LIST_DIR}")
set(gpukit_packaging_work "${CMAKE_CURRENT_BINARY_DIR}/packaging")
string(REPLACE ";" "|" gpukit_packaging_cuda_includes "${CUDAToolkit_INCLUDE_DIRS}")
get_filename_component(gpukit_packaging_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
set(gpukit_packaging_args
  "-DSOURCE_DIR=${PROJECT_SOURCE_DIR}"
  "-DPREFIX=${gpukit_packaging_work}/install/prefix"
  "-DVERSION=${PROJECT_VERSION}"
  "-DGENERATOR=${CMAKE_GENERATOR}"
  "-DMAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}"
  "-DCXX_COMPILER=${CMAKE_CXX_COMPILER}"
  "-DCTEST_COMMAND=${CMAKE_CTEST_COMMAND}"
  "-DCUDA_INCLUDE_DIRS=${gpukit_packaging_cuda_includes}"
  "-DCUDA_LIBRARY_DIR=${CUDAToolkit_LIBRARY_DIR}"
  "-DCUDA_ROOT=${gpukit_packaging_cuda_root}")

# gpukit_add_packaging_test(<name> [TIMEOUT <s>] [FIXTURES_SETUP <f>] [FIXTURES_REQUIRED <f>])
# runs tests/packaging/<name>.cmake. Each test builds with -j2 and claims 2 processors from ctest -j.
function(gpukit_add_packaging_test name)
  cmake_parse_arguments(arg "" "TIMEOUT;FIXTURES_SETUP;FIXTURES_REQUIRED" "" ${ARGN})
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 300)
  endif()
  add_test(NAME "packaging.${name}"
    COMMAND "${CMAKE_COMMAND}" "-DTEST_NAME=packaging.${name}" "-DWORK_DIR=${gpukit_packaging_work}/${name}"
            ${gpukit_packaging_args} -P "${gpukit_packaging_drivers}/${name}.cmake")
  set_tests_properties("packaging.${name}" PROPERTIES LABELS packaging TIMEOUT ${arg_TIMEOUT} PROCESSORS 2)
  if(arg_FIXTURES_SETUP)
    set_tests_properties("packaging.${name}" PROPERTIES FIXTURES_SETUP ${arg_FIXTURES_SETUP})
  endif()
  if(arg_FIXTURES_REQUIRED)
    set_tests_properties("packaging.${name}" PROPERTIES FIXTURES_REQUIRED ${arg_FIXTURES_REQUIRED})
  endif()
endfunction()

gpukit_add_packaging_test(install FIXTURES_SETUP gpukit_installed)
gpukit_add_packaging_test(find_package FIXTURES_REQUIRED gpukit_installed)
gpukit_add_packaging_test(pkg_config FIXTURES_REQUIRED gpukit_installed)
gpukit_add_packaging_test(add_subdirectory)
gpukit_add_packaging_test(fetchcontent)
gpukit_add_packaging_test(conan TIMEOUT 600)
gpukit_add_packaging_test(vcpkg_files FIXTURES_REQUIRED gpukit_installed)
gpukit_add_packaging_test(release)
# Exit status 77: a shallow clone, which lacks the release commit to build the archive from.
add_test(NAME packaging.vcpkg_release COMMAND bash "${PROJECT_SOURCE_DIR}/packaging/release.sh" --check)
set_tests_properties(packaging.vcpkg_release PROPERTIES LABELS packaging TIMEOUT 120 SKIP_RETURN_CODE 77)
