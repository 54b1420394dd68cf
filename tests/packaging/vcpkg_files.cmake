# packaging.vcpkg_files: vcpkg is not available here, so this checks what can be checked without it:
#  - every JSON file of the port and of the manifest-mode consumer parses (python3 -m json.tool), the port's version
#    is gpukit's, its dependencies are cuda plus the host ports vcpkg-cmake and vcpkg-cmake-config;
#  - the portfile's CONFIG_PATH is where gpukit's install puts its CMake package (checked on the fixture's install
#    tree), and gpukit.pc is where vcpkg_fixup_pkgconfig looks;
#  - the portfile's own logic, run with vcpkg's helper functions replaced by recorders (vcpkg_portfile_mock.cmake):
#    inside the checkout it builds the checkout, copied elsewhere (a registry) it downloads tag v<version> from
#    GitHub, and it refuses a checkout whose version differs from the port's.
# It does not prove that vcpkg builds the port.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")
packaging_fresh_dir("${WORK_DIR}")
set(vcpkg_dir "${SOURCE_DIR}/packaging/vcpkg")
set(port "${vcpkg_dir}/ports/gpukit")

find_program(python NAMES python3 python NO_CACHE)
if(NOT python)
  packaging_fail("python3 was not found (needed to validate the JSON files)")
endif()
foreach(json "${port}/vcpkg.json" "${vcpkg_dir}/test/vcpkg.json" "${vcpkg_dir}/test/vcpkg-configuration.json")
  packaging_run("python3 -m json.tool ${json}" COMMAND "${python}" -m json.tool "${json}")
endforeach()

# --- port manifest ---
file(READ "${port}/vcpkg.json" manifest)
string(JSON name GET "${manifest}" name)
string(JSON port_version GET "${manifest}" version)
if(NOT name STREQUAL "gpukit" OR NOT port_version STREQUAL VERSION)
  packaging_fail("ports/gpukit/vcpkg.json says ${name} ${port_version}; gpukit is at ${VERSION} "
                 "(include/gpukit/version.hpp): update \"version\"")
endif()
set(deps "")
string(JSON n LENGTH "${manifest}" dependencies)
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  string(JSON type TYPE "${manifest}" dependencies ${i})
  if(type STREQUAL "STRING")
    string(JSON dep GET "${manifest}" dependencies ${i})
  else()
    string(JSON dep GET "${manifest}" dependencies ${i} name)
    string(JSON host ERROR_VARIABLE no_host GET "${manifest}" dependencies ${i} host)
    if(host STREQUAL "ON")
      string(APPEND dep "(host)")
    endif()
  endif()
  list(APPEND deps "${dep}")
endforeach()
list(SORT deps)
if(NOT deps STREQUAL "cuda;vcpkg-cmake(host);vcpkg-cmake-config(host)")
  packaging_fail("ports/gpukit/vcpkg.json dependencies should be cuda and the host ports vcpkg-cmake, "
                 "vcpkg-cmake-config; they are: ${deps}")
endif()
message(STATUS "port manifest: gpukit ${port_version}, dependencies ${deps}")

# --- manifest-mode consumer ---
file(READ "${vcpkg_dir}/test/vcpkg.json" consumer)
string(JSON dep0 GET "${consumer}" dependencies 0)
file(READ "${vcpkg_dir}/test/vcpkg-configuration.json" configuration)
string(JSON overlay GET "${configuration}" overlay-ports 0)
get_filename_component(overlay "${vcpkg_dir}/test/${overlay}" ABSOLUTE)
if(NOT dep0 STREQUAL "gpukit" OR NOT EXISTS "${overlay}/gpukit/portfile.cmake")
  packaging_fail("packaging/vcpkg/test must depend on gpukit and overlay ${vcpkg_dir}/ports "
                 "(dependency: ${dep0}, overlay: ${overlay})")
endif()

# --- usage ---
file(READ "${port}/usage" usage)
packaging_expect_match("ports/gpukit/usage" "${usage}" "find_package\\(gpukit CONFIG REQUIRED\\)" "gpukit::gpukit")

# --- the portfile's paths agree with gpukit's install ---
file(READ "${port}/portfile.cmake" portfile)
packaging_expect_match("portfile.cmake" "${portfile}" "set\\(VCPKG_BUILD_TYPE release\\)"
  "vcpkg_cmake_config_fixup\\(CONFIG_PATH ([^ )]+)\\)")
string(REGEX MATCH "vcpkg_cmake_config_fixup\\(CONFIG_PATH ([^ )]+)\\)" _ "${portfile}")
set(config_path "${CMAKE_MATCH_1}")
if(NOT EXISTS "${PREFIX}/${config_path}/gpukitConfig.cmake")
  packaging_fail("the portfile fixes up CONFIG_PATH ${config_path}, but gpukit's install has no "
                 "${config_path}/gpukitConfig.cmake (see ${PREFIX})")
endif()
if(NOT EXISTS "${PREFIX}/lib/pkgconfig/gpukit.pc")
  packaging_fail("gpukit's install has no lib/pkgconfig/gpukit.pc for vcpkg_fixup_pkgconfig")
endif()
message(STATUS "CONFIG_PATH ${config_path} is where gpukit installs gpukitConfig.cmake")

# --- the portfile's logic, with vcpkg's functions recorded instead of run ---
function(run_portfile what port_dir version log)
  packaging_run("${what}" ${ARGN} OUTPUT_VARIABLE out
    COMMAND "${CMAKE_COMMAND}" "-DPORTFILE=${port_dir}/portfile.cmake" "-DCURRENT_PORT_DIR=${port_dir}"
            "-DVERSION=${version}" "-DCURRENT_PACKAGES_DIR=${WORK_DIR}/packages" "-DLOG=${log}"
            -P "${PACKAGING_DIR}/vcpkg_portfile_mock.cmake")
  set(out "${out}" PARENT_SCOPE)
endfunction()

run_portfile("portfile from the checkout (mocked vcpkg functions)" "${port}" "${VERSION}" "${WORK_DIR}/checkout.log")
file(READ "${WORK_DIR}/checkout.log" log)
packaging_expect_match("portfile from the checkout" "${log}"
  "vcpkg_cmake_configure SOURCE_PATH=${SOURCE_DIR} OPTIONS=[^\n]*-DGPUKIT_BUILD_TESTS=OFF"
  "-DGPUKIT_BUILD_EXAMPLES=OFF" "-DGPUKIT_BUILD_BENCHMARKS=OFF" "\nvcpkg_cmake_install\n"
  "\nvcpkg_cmake_config_fixup CONFIG_PATH=${config_path} " "\nvcpkg_fixup_pkgconfig\n"
  "\nvcpkg_install_copyright FILE_LIST=${SOURCE_DIR}/LICENSE\n" "\nVCPKG_BUILD_TYPE=release\n")
if(log MATCHES "vcpkg_from_github")
  packaging_fail("inside the checkout the portfile should build the checkout, not download:\n${log}")
endif()
if(NOT EXISTS "${WORK_DIR}/packages/share/gpukit/usage")
  packaging_fail("the portfile did not install usage into share/gpukit")
endif()

set(registry_port "${WORK_DIR}/registry/ports/gpukit")
file(COPY "${port}/" DESTINATION "${registry_port}")
run_portfile("portfile copied into a registry (mocked vcpkg functions)" "${registry_port}" "${VERSION}"
  "${WORK_DIR}/registry.log")
file(READ "${WORK_DIR}/registry.log" log)
packaging_expect_match("portfile in a registry" "${log}"
  "^vcpkg_from_github REPO=gpukit/gpukit REF=v${VERSION} "
  "\nvcpkg_cmake_configure SOURCE_PATH=${WORK_DIR}/packages/../buildtrees/src/downloaded ")

run_portfile("portfile from a checkout whose version is not the port's is refused" "${port}" "999.0.0"
  "${WORK_DIR}/mismatch.log" EXPECT_FAILURE)
packaging_expect_match("the refusal" "${out}" "update \"version\"")
message(STATUS "vcpkg port files: ok (vcpkg itself was not run)")
