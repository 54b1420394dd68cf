# Development overlay port: the registry port (../../ports/gpukit) building the checkout it sits in, uncommitted
# changes included, instead of downloading a release. vcpkg's binary cache keys on these port files, not on the
# checkout: install with --binarysource=clear (or --editable) or a build of older sources is restored.
#   vcpkg install gpukit --overlay-ports=<checkout>/packaging/vcpkg/dev-ports --binarysource=clear
get_filename_component(gpukit_checkout "${CMAKE_CURRENT_LIST_DIR}/../../../.." ABSOLUTE)

file(STRINGS "${gpukit_checkout}/include/gpukit/version.hpp" gpukit_version_lines
     REGEX "^#define GPUKIT_VERSION_(MAJOR|MINOR|PATCH) [0-9]+$")
set(gpukit_checkout_version "")
foreach(part MAJOR MINOR PATCH)
  string(REGEX MATCH "GPUKIT_VERSION_${part} ([0-9]+)" _ "${gpukit_version_lines}")
  list(APPEND gpukit_checkout_version "${CMAKE_MATCH_1}")
endforeach()
list(JOIN gpukit_checkout_version "." gpukit_checkout_version)
if(NOT gpukit_checkout_version STREQUAL VERSION)
  message(FATAL_ERROR "gpukit: the checkout is version ${gpukit_checkout_version} (include/gpukit/version.hpp) "
                      "but the port says ${VERSION}: update \"version\" in ${CMAKE_CURRENT_LIST_DIR}/vcpkg.json")
endif()

# The registry port's only download is vcpkg_from_github: answer it with the checkout.
function(vcpkg_from_github)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "OUT_SOURCE_PATH" "")
  message(STATUS "gpukit: building the checkout at ${gpukit_checkout}")
  set(${arg_OUT_SOURCE_PATH} "${gpukit_checkout}" PARENT_SCOPE)
endfunction()
include("${gpukit_checkout}/packaging/vcpkg/ports/gpukit/portfile.cmake")
