# vcpkg port of gpukit (header-only). Two ways to use it:
#
# * From a gpukit checkout, as an overlay port:
#     vcpkg install gpukit --overlay-ports=<checkout>/packaging/vcpkg/ports --binarysource=clear
#   When this file is <checkout>/packaging/vcpkg/ports/gpukit/portfile.cmake, i.e. inside a gpukit source tree at
#   its own place, the port builds that checkout as it is, uncommitted changes included. vcpkg's ABI hash covers
#   the port's files, not the checkout, so pass --binarysource=clear or a cached build of older sources is reused.
# * Copied into a registry (ports/gpukit/ of a vcpkg clone or of a custom registry): there is no checkout around it,
#   so it downloads the release tag v${VERSION} from GitHub, checked against SHA512. On each release, set "version"
#   in vcpkg.json and the SHA512 below (vcpkg prints the right value when the one given is wrong).
# The choice is made by location alone and defaults to GitHub: nothing needs setting in either case.

set(VCPKG_BUILD_TYPE release)  # header-only: one configuration is enough

get_filename_component(gpukit_checkout "${CURRENT_PORT_DIR}/../../../.." ABSOLUTE)
set(gpukit_self "${gpukit_checkout}/packaging/vcpkg/ports/gpukit/portfile.cmake")
get_filename_component(gpukit_self_real "${gpukit_self}" REALPATH)
get_filename_component(gpukit_this_real "${CMAKE_CURRENT_LIST_FILE}" REALPATH)
if(EXISTS "${gpukit_checkout}/include/gpukit/version.hpp" AND EXISTS "${gpukit_checkout}/CMakeLists.txt"
   AND gpukit_self_real STREQUAL gpukit_this_real)
  set(SOURCE_PATH "${gpukit_checkout}")
  message(STATUS "gpukit: building the checkout at ${SOURCE_PATH}")
  file(STRINGS "${SOURCE_PATH}/include/gpukit/version.hpp" gpukit_version_lines
       REGEX "^#define GPUKIT_VERSION_(MAJOR|MINOR|PATCH) [0-9]+$")
  set(gpukit_checkout_version "")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX MATCH "GPUKIT_VERSION_${part} ([0-9]+)" _ "${gpukit_version_lines}")
    list(APPEND gpukit_checkout_version "${CMAKE_MATCH_1}")
  endforeach()
  list(JOIN gpukit_checkout_version "." gpukit_checkout_version)
  if(NOT gpukit_checkout_version STREQUAL VERSION)
    message(FATAL_ERROR "gpukit: the checkout is version ${gpukit_checkout_version} (include/gpukit/version.hpp) "
                        "but the port says ${VERSION}: update \"version\" in ${CURRENT_PORT_DIR}/vcpkg.json")
  endif()
else()
  vcpkg_from_github(
    OUT_SOURCE_PATH SOURCE_PATH
    REPO gpukit/gpukit
    REF "v${VERSION}"
    SHA512 0
    HEAD_REF main
  )
endif()

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DGPUKIT_BUILD_TESTS=OFF
    -DGPUKIT_BUILD_EXAMPLES=OFF
    -DGPUKIT_BUILD_BENCHMARKS=OFF
    -DGPUKIT_INSTALL=ON
    -DGPUKIT_INSTALL_CMAKEDIR=share/cmake/gpukit
)
vcpkg_cmake_install()

# gpukit installs its CMake package to share/cmake/gpukit; vcpkg wants it in share/gpukit.
vcpkg_cmake_config_fixup(CONFIG_PATH share/cmake/gpukit)
# gpukit.pc has Libs (-lcudart ...), so it stays in lib/pkgconfig; prefix is made relative to the .pc file.
vcpkg_fixup_pkgconfig()

file(REMOVE_RECURSE
  "${CURRENT_PACKAGES_DIR}/debug"
  "${CURRENT_PACKAGES_DIR}/share/cmake"       # empty once the config has moved to share/gpukit
  "${CURRENT_PACKAGES_DIR}/share/doc"         # the license goes to share/gpukit/copyright instead
)
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
