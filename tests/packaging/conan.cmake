# packaging.conan: the recipe files hold no Conan 1 attribute; `conan create packaging/conan` builds the Conan 2
# package from this checkout without a CUDA toolkit, then builds and runs its test_package; unsupported consumer
# configurations are refused with a message that says why; a program built with only the gpukit.pc that PkgConfigDeps
# generates runs. CONAN_HOME is a directory of this test (the user's ~/.conan2 is never touched) and nothing is
# fetched: gpukit has no Conan requirements, and --no-remote keeps Conan off the network. test_package/ is copied
# into the build tree first so that Conan writes nothing into the source tree.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")
packaging_fresh_dir("${WORK_DIR}")

# Conan 2 ignores Conan-1-only attributes silently (test_type) or fails only on the path that uses them, so the
# recipe files are searched for them.
file(GLOB_RECURSE recipes "${SOURCE_DIR}/packaging/conan/*.py")
list(LENGTH recipes n)
if(n LESS 2)
  packaging_fail("expected the recipe and test_package/conanfile.py under packaging/conan, found: ${recipes}")
endif()
foreach(recipe IN LISTS recipes)
  file(READ "${recipe}" text)
  foreach(conan1 "test_type" "self.copy(" "from conans " "from conans." "import conans" "cpp_info.names"
                 "cpp_info.filenames" "build_requires =" "self.build_requires(")
    string(FIND "${text}" "${conan1}" at)
    if(NOT at EQUAL -1)
      packaging_fail("${recipe} uses the Conan 1 attribute \"${conan1}\"")
    endif()
  endforeach()
endforeach()
message(STATUS "no Conan 1 attribute in the ${n} recipe files")

if(DEFINED ENV{GPUKIT_CONAN_EXECUTABLE} AND NOT "$ENV{GPUKIT_CONAN_EXECUTABLE}" STREQUAL "")
  set(conan "$ENV{GPUKIT_CONAN_EXECUTABLE}")
else()
  find_program(conan NAMES conan HINTS /usr/local/bin "$ENV{HOME}/.local/bin" NO_CACHE)
endif()
if(NOT conan OR NOT EXISTS "${conan}")
  packaging_fail("Conan 2 was not found, so the Conan package cannot be tested. Install it with "
                 "`bash .ci/install-deps` (or `python3 -m pip install 'conan>=2,<3'`), or point "
                 "GPUKIT_CONAN_EXECUTABLE at it; or configure with -DGPUKIT_TEST_PACKAGING=OFF.")
endif()
packaging_run("conan --version" SHOW_OUTPUT OUTPUT_VARIABLE conan_version COMMAND "${conan}" --version)
if(NOT conan_version MATCHES "version 2\\.")
  packaging_fail("${conan} is not Conan 2: ${conan_version}")
endif()

set(ENV{CONAN_HOME} "${WORK_DIR}/conan-home")
packaging_run("conan profile detect --exist-ok (CONAN_HOME=${WORK_DIR}/conan-home)"
  COMMAND "${conan}" profile detect --exist-ok)

file(COPY "${SOURCE_DIR}/packaging/conan/test_package" DESTINATION "${WORK_DIR}")
set(conf -c tools.build:jobs=2)
if(GENERATOR STREQUAL "Ninja")
  list(APPEND conf -c tools.cmake.cmaketoolchain:generator=Ninja)
endif()
packaging_run("conan create packaging/conan (builds the package, then builds and runs test_package)" SHOW_OUTPUT
  OUTPUT_VARIABLE out
  COMMAND "${conan}" create "${SOURCE_DIR}/packaging/conan" --test-folder "${WORK_DIR}/test_package" --no-remote
          ${conf})
packaging_expect_match("conan create" "${out}" "gpukit/${VERSION}"
  "gpukit ${VERSION} from Conan \\(header-only\\): .*stream work done, allocated")
# The recipe hides the CUDA toolkit from gpukit's configure: creating the package needs none.
packaging_expect_match("conan create configures gpukit without CUDA" "${out}"
  "gpukit: no CUDA toolkit found: gpukit\\.pc is not installed")

# The package is the same for every configuration, and holds gpukit's own CMake package.
packaging_run("conan list gpukit/${VERSION}:*" OUTPUT_VARIABLE listing COMMAND "${conan}" list "gpukit/${VERSION}:*")
packaging_expect_match("conan list" "${listing}" "da39a3ee5e6b4b0d3255bfef95601890afd80709")
# conan_package_folder(<out-var> <what> <package id> <files that must be in it...>)
function(conan_package_folder out what id)
  packaging_run("conan cache path of the ${what}" OUTPUT_VARIABLE folder
    COMMAND "${conan}" cache path "gpukit/${VERSION}:${id}")
  string(STRIP "${folder}" folder)
  foreach(file IN LISTS ARGN)
    if(NOT EXISTS "${folder}/${file}")
      packaging_fail("the ${what} (${folder}) lacks ${file}")
    endif()
  endforeach()
  set(${out} "${folder}" PARENT_SCOPE)
endfunction()
conan_package_folder(package_folder "Conan package" da39a3ee5e6b4b0d3255bfef95601890afd80709
  include/gpukit/gpukit.hpp share/cmake/gpukit/gpukitConfig.cmake share/cmake/gpukit/gpukitTargets.cmake
  licenses/LICENSE)
if(EXISTS "${package_folder}/lib")
  packaging_fail("the Conan package (${package_folder}) has a lib/ directory (gpukit.pc?)")
endif()
message(STATUS "the Conan package holds gpukit's headers, its CMake package and the license")

# --- compiled=True: the package also holds gpukit::compiled (libgpukit.a), built against the toolkit found here ---
if(NOT CUDA_ROOT OR NOT EXISTS "${CUDA_ROOT}/include")
  packaging_fail("-DCUDA_ROOT=<the CUDA toolkit the outer build found> is missing or wrong: \"${CUDA_ROOT}\"")
endif()
set(ENV{CUDAToolkit_ROOT} "${CUDA_ROOT}")
packaging_run("conan create packaging/conan -o gpukit/*:compiled=True (builds libgpukit.a; test_package links "
              "gpukit::compiled)" SHOW_OUTPUT OUTPUT_VARIABLE out
  COMMAND "${conan}" create "${SOURCE_DIR}/packaging/conan" --test-folder "${WORK_DIR}/test_package" --no-remote
          -o "gpukit/*:compiled=True" ${conf})
unset(ENV{CUDAToolkit_ROOT})
packaging_expect_match("conan create -o compiled=True" "${out}"
  "gpukit ${VERSION} from Conan \\(compiled mode\\): .*stream work done, allocated")
packaging_run("conan list gpukit/${VERSION}:* after the compiled package" OUTPUT_VARIABLE listing
  COMMAND "${conan}" list "gpukit/${VERSION}:*" --format=json)
# The package whose options say compiled=True (the header-only package's info is empty).
string(JSON revisions GET "${listing}" "Local Cache" "gpukit/${VERSION}" revisions)
string(JSON revision MEMBER "${revisions}" 0)
string(JSON packages GET "${revisions}" "${revision}" packages)
string(JSON package_count LENGTH "${packages}")
math(EXPR last "${package_count} - 1")
set(compiled_id "")
foreach(i RANGE ${last})
  string(JSON id MEMBER "${packages}" ${i})
  string(JSON compiled ERROR_VARIABLE no_option GET "${packages}" "${id}" info options compiled)
  if(compiled STREQUAL "True")
    set(compiled_id "${id}")
  endif()
endforeach()
if(compiled_id STREQUAL "")
  packaging_fail("conan list shows no package with compiled=True:\n${listing}")
endif()
conan_package_folder(compiled_folder "compiled Conan package" "${compiled_id}"
  lib/libgpukit.a share/cmake/gpukit/gpukitCompiledTargets.cmake include/gpukit/gpukit.hpp)
if(EXISTS "${compiled_folder}/lib/pkgconfig")
  packaging_fail("the compiled Conan package (${compiled_folder}) holds gpukit.pc, which records this machine's paths")
endif()
message(STATUS "the compiled Conan package holds libgpukit.a and gpukit::compiled's CMake targets")

# Who may use the package is decided in validate() with the consumer's settings (package_id() clears them for the
# package id, not for validate()). A refused configuration must say why.
function(conan_expect_refused what regex)
  string(JOIN " " shown ${ARGN})
  packaging_run("conan install --requires=gpukit/${VERSION} ${shown} is refused" EXPECT_FAILURE OUTPUT_VARIABLE out
    COMMAND "${conan}" install "--requires=gpukit/${VERSION}" ${ARGN} --no-remote
            --output-folder "${WORK_DIR}/refused")
  packaging_expect_match("the refusal of ${what}" "${out}" "gpukit/${VERSION}: Invalid: [^\n]*${regex}")
endfunction()

# CUDA's platforms only: Linux on x86_64 or armv8. The message names the platform that was asked for.
set(platforms "gpukit supports Linux on x86_64 or armv8 only")
conan_expect_refused("Windows" "${platforms}[^\n]*: not Windows on x86_64" -s os=Windows)
conan_expect_refused("FreeBSD" "${platforms}[^\n]*: not FreeBSD on x86_64" -s os=FreeBSD)
conan_expect_refused("32-bit x86" "${platforms}[^\n]*: not Linux on x86\n" -s arch=x86)
packaging_run("conan install --requires=gpukit/${VERSION} -s arch=armv8 is accepted"
  COMMAND "${conan}" install "--requires=gpukit/${VERSION}" -s arch=armv8 --no-remote
          --output-folder "${WORK_DIR}/armv8")

# gpukit is C++17: a consumer profile with an older standard is refused (conan create above used the detected
# profile's standard, gnu17 for gcc 12).
conan_expect_refused("C++14" "Current cppstd \\(14\\) is lower than the required C\\+\\+ standard \\(17\\)"
  -s compiler.cppstd=14)

# --- PkgConfigDeps: a consumer that is not CMake gets CUDA from package_info ---
# The CUDA root is the consumer's: the conf user.gpukit:cuda_root at install time, else CUDA_PATH, CUDA_HOME,
# /usr/local/cuda. CUDA_PATH names a directory that holds no toolkit, so the program below builds only if the conf
# wins; then, without the conf, CUDA_PATH must.
if(NOT CUDA_ROOT OR NOT EXISTS "${CUDA_ROOT}/include")
  packaging_fail("-DCUDA_ROOT=<the CUDA toolkit the outer build found> is missing or wrong: \"${CUDA_ROOT}\"")
endif()
find_program(pkg_config NAMES pkg-config pkgconf)
if(NOT pkg_config)
  packaging_fail("pkg-config was not found (Debian: apt-get install pkg-config; or run .ci/install-deps)")
endif()
set(ENV{CUDA_PATH} "${WORK_DIR}/not-a-cuda-toolkit")
set(pc_dir "${WORK_DIR}/pkgconfigdeps")
packaging_run("conan install --requires=gpukit/${VERSION} -g PkgConfigDeps -c user.gpukit:cuda_root=${CUDA_ROOT}"
  COMMAND "${conan}" install "--requires=gpukit/${VERSION}" -g PkgConfigDeps -c "user.gpukit:cuda_root=${CUDA_ROOT}"
          --no-remote --output-folder "${pc_dir}")
if(NOT EXISTS "${pc_dir}/gpukit.pc")
  packaging_fail("PkgConfigDeps wrote no gpukit.pc into ${pc_dir}")
endif()
file(READ "${pc_dir}/gpukit.pc" pc)
foreach(expected "${CUDA_ROOT}/include" "-lcudart" "-lpthread" "-ldl")
  string(FIND "${pc}" "${expected}" at)
  if(at EQUAL -1)
    packaging_fail("gpukit.pc from PkgConfigDeps does not name ${expected}:\n${pc}")
  endif()
endforeach()

# Only the generated gpukit.pc counts: no other pkg-config directory, no compiler search path from the environment.
set(ENV{PKG_CONFIG_PATH} "${pc_dir}")
set(ENV{PKG_CONFIG_LIBDIR} "${pc_dir}")
set(program "${WORK_DIR}/pkgconfigdeps-consumer")
packaging_compile_with_pkg_config("PkgConfigDeps" "${pkg_config}" "${program}")
packaging_run_consumer("run the PkgConfigDeps consumer" "${program}")

packaging_run("conan install -g PkgConfigDeps without the conf: CUDA_PATH is the CUDA root" OUTPUT_VARIABLE out
  COMMAND "${conan}" install "--requires=gpukit/${VERSION}" -g PkgConfigDeps --no-remote
          --output-folder "${WORK_DIR}/pkgconfigdeps-cuda-path")
file(READ "${WORK_DIR}/pkgconfigdeps-cuda-path/gpukit.pc" pc)
string(FIND "${pc}" "$ENV{CUDA_PATH}/include" at)
if(at EQUAL -1)
  packaging_fail("without user.gpukit:cuda_root, gpukit.pc from PkgConfigDeps should name $ENV{CUDA_PATH}/include:\n"
                 "${pc}")
endif()
packaging_expect_match("conan install warns about a CUDA root without a toolkit" "${out}"
  "gpukit/${VERSION}: WARN: [^\n]*no CUDA toolkit in [^\n]*not-a-cuda-toolkit")
message(STATUS "PkgConfigDeps: gpukit.pc names the consumer's CUDA root")
