# packaging.vcpkg_files: vcpkg is not available here, so this checks what can be checked without it:
#  - the JSON files parse; the registry port (ports/gpukit) and the development port (dev-ports/gpukit) have the same
#    manifest but for the version (the development port's is the checkout's, the registry port's a release not
#    newer) and the feature "compiled", which the development port has and release 0.1.0 predates;
#    dependencies are cuda and the host ports vcpkg-cmake, vcpkg-cmake-config; "supports" is no wider than the cuda
#    port's;
#  - the registry portfile is plain, as registry reviewers want it: no self-location, no branches, no comment block;
#  - both portfiles run with vcpkg's helper functions replaced by stand-ins (vcpkg_portfile_mock.cmake): the registry
#    port downloads tag v<version>, the development port builds the checkout (and refuses one of another version);
#    both pass the toolkit the cuda port found, and the package they leave (the fixture's install run through the
#    portfile's own fix-ups) holds the headers and the CMake package in share/gpukit, no gpukit.pc, no empty
#    directory and no path of this machine; with the feature "compiled", libgpukit.a and its export set as well.
# It does not prove that vcpkg builds the port.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")
packaging_fresh_dir("${WORK_DIR}")
set(vcpkg_dir "${SOURCE_DIR}/packaging/vcpkg")
set(port "${vcpkg_dir}/ports/gpukit")
set(dev_port "${vcpkg_dir}/dev-ports/gpukit")
# ports/cuda/vcpkg.json in microsoft/vcpkg.
set(cuda_port_supports "(windows & x64 & !uwp) | (linux & x64) | (linux & arm64)")

find_program(python NAMES python3 python NO_CACHE)
if(NOT python)
  packaging_fail("python3 was not found (needed to validate the JSON files)")
endif()
foreach(json "${port}/vcpkg.json" "${dev_port}/vcpkg.json" "${vcpkg_dir}/test/vcpkg.json"
             "${vcpkg_dir}/test/vcpkg-configuration.json")
  packaging_run("python3 -m json.tool ${json}" COMMAND "${python}" -m json.tool "${json}")
endforeach()

# --- the manifests ---
file(READ "${port}/vcpkg.json" manifest)
file(READ "${dev_port}/vcpkg.json" dev_manifest)
string(JSON name GET "${manifest}" name)
string(JSON registry_version GET "${manifest}" version)
string(JSON dev_version GET "${dev_manifest}" version)
if(NOT name STREQUAL "gpukit" OR NOT dev_version STREQUAL VERSION)
  packaging_fail("dev-ports/gpukit/vcpkg.json says ${name} ${dev_version}; the checkout is at ${VERSION} "
                 "(include/gpukit/version.hpp): update \"version\"")
endif()
if(registry_version VERSION_GREATER VERSION)
  packaging_fail("ports/gpukit/vcpkg.json is at ${registry_version}, newer than the checkout's ${VERSION}")
endif()
# The development port offers the feature "compiled" (gpukit::compiled); a registry port at a release from before
# the feature (0.1.0) does not, and release.sh copies the development port's manifest at the next release.
string(JSON compiled_feature ERROR_VARIABLE no_compiled_feature GET "${dev_manifest}" features compiled description)
if(no_compiled_feature)
  packaging_fail("dev-ports/gpukit/vcpkg.json has no feature \"compiled\" (gpukit::compiled): ${no_compiled_feature}")
endif()
string(JSON dev_manifest SET "${dev_manifest}" version "\"${registry_version}\"")
string(JSON registry_features ERROR_VARIABLE registry_has_no_features GET "${manifest}" features)
if(registry_has_no_features AND registry_version VERSION_EQUAL 0.1.0)
  string(JSON dev_manifest REMOVE "${dev_manifest}" features)
endif()
string(JSON same EQUAL "${manifest}" "${dev_manifest}")
if(NOT same)
  packaging_fail("ports/gpukit/vcpkg.json and dev-ports/gpukit/vcpkg.json differ in more than the version (and the "
                 "features, which release 0.1.0 predates)")
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
string(JSON supports GET "${manifest}" supports)
packaging_run("\"supports\": \"${supports}\" allows nothing the cuda port's \"${cuda_port_supports}\" excludes"
  SHOW_OUTPUT COMMAND "${python}" "${PACKAGING_DIR}/vcpkg_supports.py" "${supports}" "${cuda_port_supports}")
message(STATUS "manifests: registry port ${registry_version}, development port ${dev_version}, dependencies ${deps}")

# --- manifest-mode consumer and usage ---
file(READ "${vcpkg_dir}/test/vcpkg.json" consumer)
string(JSON dep0 GET "${consumer}" dependencies 0)
file(READ "${vcpkg_dir}/test/vcpkg-configuration.json" configuration)
string(JSON overlay GET "${configuration}" overlay-ports 0)
get_filename_component(overlay "${vcpkg_dir}/test/${overlay}" ABSOLUTE)
if(NOT dep0 STREQUAL "gpukit" OR NOT overlay STREQUAL "${vcpkg_dir}/dev-ports")
  packaging_fail("packaging/vcpkg/test must depend on gpukit and overlay ${vcpkg_dir}/dev-ports "
                 "(dependency: ${dep0}, overlay: ${overlay})")
endif()
file(READ "${port}/usage" usage)
file(READ "${dev_port}/usage" dev_usage)
packaging_expect_match("ports/gpukit/usage" "${usage}" "find_package\\(gpukit CONFIG REQUIRED\\)" "gpukit::gpukit")
if(NOT usage STREQUAL dev_usage)
  packaging_fail("ports/gpukit/usage and dev-ports/gpukit/usage differ")
endif()

# --- the registry portfile is plain ---
file(STRINGS "${port}/portfile.cmake" lines)
set(comment_run 0)
foreach(line IN LISTS lines)
  if(line MATCHES "^[ ]*#")
    math(EXPR comment_run "${comment_run} + 1")
    if(comment_run GREATER 2)
      packaging_fail("ports/gpukit/portfile.cmake has a comment block of more than 2 lines: registry ports keep "
                     "comments short (explanations belong in the README)")
    endif()
  else()
    set(comment_run 0)
  endif()
  if(line MATCHES "(^|[^_a-z])(if|get_filename_component)\\(|CMAKE_CURRENT_LIST_FILE|\\.\\./")
    packaging_fail("ports/gpukit/portfile.cmake must be a plain registry portfile (no branches, no "
                   "self-location), but has: ${line}")
  endif()
endforeach()
file(READ "${port}/portfile.cmake" portfile)
packaging_expect_match("ports/gpukit/portfile.cmake" "${portfile}" "set\\(VCPKG_BUILD_TYPE release\\)"
  "vcpkg_cmake_config_fixup\\(CONFIG_PATH ([^ )]+)\\)" "vcpkg_from_github\\(")
string(REGEX MATCH "vcpkg_cmake_config_fixup\\(CONFIG_PATH ([^ )]+)\\)" _ "${portfile}")
set(config_path "${CMAKE_MATCH_1}")
string(REGEX MATCH "\n *SHA512 ([0-9A-Za-z]+)\n" _ "${portfile}")
set(sha512 "${CMAKE_MATCH_1}")
if(NOT EXISTS "${PREFIX}/${config_path}/gpukitConfig.cmake")
  packaging_fail("the portfile fixes up CONFIG_PATH ${config_path}, but gpukit's install has no "
                 "${config_path}/gpukitConfig.cmake (see ${PREFIX})")
endif()

# --- both portfiles, with vcpkg's functions replaced by stand-ins ---
string(REPLACE "|" ";" CUDA_INCLUDE_DIRS "${CUDA_INCLUDE_DIRS}")  # tests.cmake joins the list with |
set(found_cuda "/cuda-found-by-the-cuda-port")
function(run_portfile what port_dir version features log)
  packaging_run("${what}" ${ARGN} OUTPUT_VARIABLE out
    COMMAND "${CMAKE_COMMAND}" "-DPORTFILE=${port_dir}/portfile.cmake" "-DCURRENT_PORT_DIR=${port_dir}"
            "-DVERSION=${version}" "-DFEATURES=${features}" "-DCURRENT_PACKAGES_DIR=${WORK_DIR}/packages" "-DLOG=${log}"
            "-DINSTALL_TREE=${PREFIX}" "-DCUDA_ROOT=${found_cuda}" -P "${PACKAGING_DIR}/vcpkg_portfile_mock.cmake")
  set(out "${out}" PARENT_SCOPE)
endfunction()
# compiled: ON when the port was asked for gpukit::compiled (the feature "compiled"), else OFF.
function(expect_package what log source compiled)
  file(READ "${log}" text)
  packaging_expect_match("${what}" "${text}"
    "(^|\n)vcpkg_check_linkage ONLY_STATIC_LIBRARY\n"
    "\nvcpkg_find_cuda\nvcpkg_cmake_configure SOURCE_PATH=${source} OPTIONS=[^\n]*-DGPUKIT_BUILD_TESTS=OFF"
    "-DGPUKIT_BUILD_EXAMPLES=OFF" "-DGPUKIT_BUILD_BENCHMARKS=OFF" "-DGPUKIT_BUILD_COMPILED=${compiled}[;\n]"
    "-DCUDAToolkit_ROOT=${found_cuda}[;\n]"
    "\nvcpkg_cmake_install\n" "\nvcpkg_cmake_config_fixup CONFIG_PATH=${config_path} "
    "\nvcpkg_install_copyright FILE_LIST=${source}/LICENSE\n" "\nVCPKG_BUILD_TYPE=release\n")
  set(package "${WORK_DIR}/packages")
  # gpukit.pc must not be installed into the package (it would record this machine's CUDA paths).
  string(REGEX MATCH "-DGPUKIT_INSTALL_PKGCONFIGDIR=([^ ;\n]*)" _ "${text}")
  set(pc_dir "${CMAKE_MATCH_1}")
  get_filename_component(pc_dir_resolved "${pc_dir}/" ABSOLUTE)
  string(FIND "${pc_dir_resolved}/" "${package}/" inside)
  if(NOT IS_ABSOLUTE "${pc_dir}" OR inside EQUAL 0)
    packaging_fail("${what}: GPUKIT_INSTALL_PKGCONFIGDIR is \"${pc_dir}\", not a directory outside the package")
  endif()
  set(allowed "^include/gpukit/|^share/gpukit/(gpukitConfig|gpukitConfigVersion|gpukitTargets)\\.cmake$|^share/gpukit/(usage|copyright)$")
  if(compiled)
    string(APPEND allowed "|^lib/libgpukit\\.a$|^share/gpukit/gpukitCompiledTargets(-[a-z]+)?\\.cmake$")
  endif()
  file(GLOB_RECURSE dirs LIST_DIRECTORIES true RELATIVE "${package}" "${package}/*")
  foreach(dir IN LISTS dirs)
    file(GLOB entries "${package}/${dir}/*")
    if(IS_DIRECTORY "${package}/${dir}" AND NOT entries)
      packaging_fail("${what}: the package has an empty directory, ${dir} (vcpkg's post-build checks refuse it)")
    endif()
  endforeach()
  file(GLOB_RECURSE files LIST_DIRECTORIES false RELATIVE "${package}" "${package}/*")
  foreach(file IN LISTS files)
    if(NOT file MATCHES "${allowed}")
      packaging_fail("${what}: the package holds ${file}, which belongs to no vcpkg package of gpukit (a "
                     "pkg-config file would record this machine's CUDA paths, which vcpkg's package hash ignores)")
    endif()
    if(file MATCHES "\\.a$")
      continue()  # the library may name the paths it was built from (as any vcpkg library); its export set may not
    endif()
    file(READ "${package}/${file}" content)
    foreach(path "${SOURCE_DIR}" "${PREFIX}" ${CUDA_INCLUDE_DIRS} "${CUDA_LIBRARY_DIR}")
      string(FIND "${content}" "${path}" at)
      if(NOT at EQUAL -1)
        packaging_fail("${what}: ${file} contains the path ${path} of the machine that built the package")
      endif()
    endforeach()
  endforeach()
  set(required include/gpukit/gpukit.hpp share/gpukit/gpukitConfig.cmake share/gpukit/usage share/gpukit/copyright)
  if(compiled)
    list(APPEND required lib/libgpukit.a share/gpukit/gpukitCompiledTargets.cmake)
  elseif(EXISTS "${package}/lib")
    packaging_fail("${what}: without the feature \"compiled\" the package should have no lib/")
  endif()
  foreach(file IN LISTS required)
    if(NOT EXISTS "${package}/${file}")
      packaging_fail("${what}: the package lacks ${file}")
    endif()
  endforeach()
  if(compiled)
    message(STATUS "${what}: the package holds the headers, libgpukit.a and share/gpukit, and no path of this "
                   "machine outside the library")
  else()
    message(STATUS "${what}: the package holds the headers and share/gpukit, and no path of this machine")
  endif()
endfunction()

run_portfile("registry port (stand-ins for vcpkg's functions)" "${port}" "${registry_version}" "core"
  "${WORK_DIR}/registry.log")
file(READ "${WORK_DIR}/registry.log" log)
packaging_expect_match("registry port" "${log}"
  "^vcpkg_from_github REPO=gpukit/gpukit REF=v${registry_version} SHA512=${sha512} HEAD_REF=main\n")
expect_package("registry port" "${WORK_DIR}/registry.log" "${WORK_DIR}/packages/../buildtrees/src/downloaded" OFF)

run_portfile("development port (stand-ins for vcpkg's functions)" "${dev_port}" "${VERSION}" "core"
  "${WORK_DIR}/dev.log")
file(READ "${WORK_DIR}/dev.log" log)
if(log MATCHES "vcpkg_from_github")
  packaging_fail("the development port should build the checkout, not download:\n${log}")
endif()
expect_package("development port" "${WORK_DIR}/dev.log" "${SOURCE_DIR}" OFF)

run_portfile("development port, feature compiled (stand-ins for vcpkg's functions)" "${dev_port}" "${VERSION}"
  "core|compiled" "${WORK_DIR}/dev-compiled.log")
expect_package("development port, feature compiled" "${WORK_DIR}/dev-compiled.log" "${SOURCE_DIR}" ON)

run_portfile("the development port refuses a checkout of another version" "${dev_port}" "999.0.0" "core"
  "${WORK_DIR}/mismatch.log" EXPECT_FAILURE)
packaging_expect_match("the refusal" "${out}" "update \"version\"")
message(STATUS "vcpkg port files: ok (vcpkg itself was not run)")
