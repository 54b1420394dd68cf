# Install rules for gpukit: the headers, the target gpukit::gpukit with a relocatable CMake package
# (gpukitConfig.cmake, gpukitConfigVersion.cmake), a pkg-config file and the license.
#
# The top-level CMakeLists.txt includes this file when GPUKIT_INSTALL is ON, which is the default only when gpukit is
# the top-level project. A parent project that adds gpukit with add_subdirectory or FetchContent and installs or
# exports a target linking gpukit::gpukit needs these rules as well (otherwise CMake stops with "install(EXPORT ...)
# includes target ... which requires target "gpukit" that is not in any export set"). It turns them on before adding
# gpukit; gpukit then installs itself alongside the parent, and the parent's package config does
# find_dependency(gpukit):
#
#   set(GPUKIT_INSTALL ON)                  # or set(GPUKIT_INSTALL ON CACHE BOOL "") or -DGPUKIT_INSTALL=ON
#   add_subdirectory(third_party/gpukit)    # or FetchContent_MakeAvailable(gpukit)
#
# Installed layout, relative to the install prefix (each directory can be changed with the cache variable named):
#   include/gpukit/...                     the headers                                   CMAKE_INSTALL_INCLUDEDIR
#   lib/libgpukit.a                        gpukit::compiled (if built: GPUKIT_BUILD_COMPILED) CMAKE_INSTALL_LIBDIR
#   share/cmake/gpukit/gpukit*.cmake       CMake package (architecture-independent)      GPUKIT_INSTALL_CMAKEDIR
#   lib/pkgconfig/gpukit.pc                pkg-config file (only if CUDA was found)      GPUKIT_INSTALL_PKGCONFIGDIR
#   share/doc/gpukit/LICENSE
#
# Every rule belongs to the install component `gpukit` (cmake --install <build> --component gpukit).
include(CMakePackageConfigHelpers)

set(GPUKIT_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/gpukit" CACHE STRING
    "Where gpukit's CMake package files are installed (relative to the prefix, or absolute)")
set(GPUKIT_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig" CACHE STRING
    "Where gpukit.pc is installed (relative to the prefix, or absolute)")
mark_as_advanced(GPUKIT_INSTALL_CMAKEDIR GPUKIT_INSTALL_PKGCONFIGDIR)

set(gpukit_package_dir "${PROJECT_BINARY_DIR}/gpukit-package")

# --- headers ---------------------------------------------------------------------------------------------------
# File by file rather than install(DIRECTORY): that would also create directories that hold no header yet, which
# package managers reject (vcpkg's "empty directories" check). CONFIGURE_DEPENDS re-globs on every build.
file(GLOB_RECURSE gpukit_public_files RELATIVE "${PROJECT_SOURCE_DIR}/include" CONFIGURE_DEPENDS
     "${PROJECT_SOURCE_DIR}/include/gpukit/*.hpp" "${PROJECT_SOURCE_DIR}/include/gpukit/*.h"
     "${PROJECT_SOURCE_DIR}/include/gpukit/*.cuh" "${PROJECT_SOURCE_DIR}/include/gpukit/*.inl")
foreach(gpukit_file IN LISTS gpukit_public_files)
  get_filename_component(gpukit_file_dir "${gpukit_file}" DIRECTORY)
  install(FILES "${PROJECT_SOURCE_DIR}/include/${gpukit_file}"
    DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/${gpukit_file_dir}"
    COMPONENT gpukit)
endforeach()

# --- CMake package ---------------------------------------------------------------------------------------------
# The exported gpukit::gpukit carries its include directory relative to the prefix, cxx_std_17, and the link items
# CUDA::cudart, Threads::Threads and ${CMAKE_DL_LIBS} by name: no path of this machine is recorded. gpukitConfig.cmake
# creates CUDA::cudart and Threads::Threads on the consumer's machine (find_dependency) before it loads the targets.
install(TARGETS gpukit gpukit_headers EXPORT gpukitTargets COMPONENT gpukit)
install(EXPORT gpukitTargets
  NAMESPACE gpukit::
  FILE gpukitTargets.cmake
  DESTINATION "${GPUKIT_INSTALL_CMAKEDIR}"
  COMPONENT gpukit)

# gpukit::compiled, the optional compiled mode, in an export set of its own: gpukitConfig.cmake loads it where it
# was installed, so a header-only install (a package manager's) has the same package without it.
if(TARGET gpukit_compiled)
  install(TARGETS gpukit_compiled EXPORT gpukitCompiledTargets
    ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT gpukit)
  install(EXPORT gpukitCompiledTargets
    NAMESPACE gpukit::
    FILE gpukitCompiledTargets.cmake
    DESTINATION "${GPUKIT_INSTALL_CMAKEDIR}"
    COMPONENT gpukit)
endif()

# Recorded in gpukitConfig.cmake: whether this install has gpukit::compiled (its targets file alone could be an earlier
# install's, left in the prefix).
if(TARGET gpukit_compiled)
  set(GPUKIT_INSTALLS_COMPILED TRUE)
else()
  set(GPUKIT_INSTALLS_COMPILED FALSE)
endif()
configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/gpukitConfig.cmake.in"
  "${gpukit_package_dir}/gpukitConfig.cmake"
  INSTALL_DESTINATION "${GPUKIT_INSTALL_CMAKEDIR}")
# The headers serve every architecture (ARCH_INDEPENDENT skips the pointer-size check; gpukit::compiled, an optional
# component, is of the machine that built it). While the major version is 0 a minor version may break the API
# (version.hpp), so only the same 0.y is compatible (SameMinorVersion); from 1.0 on, the same major version.
if(gpukit_VERSION_MAJOR EQUAL 0)
  set(gpukit_version_compatibility SameMinorVersion)
else()
  set(gpukit_version_compatibility SameMajorVersion)
endif()
write_basic_package_version_file("${gpukit_package_dir}/gpukitConfigVersion.cmake"
  VERSION "${gpukit_VERSION}"
  COMPATIBILITY ${gpukit_version_compatibility}
  ARCH_INDEPENDENT)
install(FILES "${gpukit_package_dir}/gpukitConfig.cmake" "${gpukit_package_dir}/gpukitConfigVersion.cmake"
  DESTINATION "${GPUKIT_INSTALL_CMAKEDIR}"
  COMPONENT gpukit)

# --- pkg-config --------------------------------------------------------------------------------------------------
# prefix is found from the .pc file's own location (${pcfiledir}), so the installed tree can be moved. pkg-config has
# no way to look for the CUDA toolkit, so the toolkit found when gpukit was configured is recorded: its include
# directory (CUDAToolkit_INCLUDE_DIRS) and library directory (CUDAToolkit_LIBRARY_DIR) become the variables
# cuda_includedir and cuda_libdir, which a user of another toolkit overrides with
# `pkg-config --define-variable=cuda_libdir=... --define-variable=cuda_includedir=...`.
# Without a toolkit (a top-level configure that builds nothing and found none, e.g. with
# -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON as the Conan recipe does) there are no paths to record, so gpukit.pc
# is not installed; the CMake package is the same either way.
if(CUDAToolkit_FOUND)
  if(IS_ABSOLUTE "${GPUKIT_INSTALL_PKGCONFIGDIR}")
    set(gpukit_pc_prefix "${CMAKE_INSTALL_PREFIX}")
  else()
    file(RELATIVE_PATH gpukit_pc_up "/gpukit-prefix/${GPUKIT_INSTALL_PKGCONFIGDIR}" "/gpukit-prefix")
    string(REGEX REPLACE "/$" "" gpukit_pc_up "${gpukit_pc_up}")
    set(gpukit_pc_prefix "\${pcfiledir}/${gpukit_pc_up}")
  endif()
  if(IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
    set(gpukit_pc_includedir "${CMAKE_INSTALL_INCLUDEDIR}")
  else()
    set(gpukit_pc_includedir "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
  endif()
  set(gpukit_pc_cuda_includedir "")
  set(gpukit_pc_cflags_extra "")
  foreach(gpukit_dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
    if(gpukit_pc_cuda_includedir STREQUAL "")
      set(gpukit_pc_cuda_includedir "${gpukit_dir}")
    else()
      string(APPEND gpukit_pc_cflags_extra " -I${gpukit_dir}")
    endif()
  endforeach()
  # The toolkit's CCCL, for the interop headers (as libcudacxx::libcudacxx in the CMake package).
  if(EXISTS "${gpukit_pc_cuda_includedir}/cccl/cuda/std/version")
    string(APPEND gpukit_pc_cflags_extra " -I\${cuda_includedir}/cccl")
  endif()
  set(gpukit_pc_cuda_libdir "${CUDAToolkit_LIBRARY_DIR}")
  set(gpukit_pc_system_libs "")
  if(UNIX)
    string(APPEND gpukit_pc_system_libs " -lpthread")
  endif()
  foreach(gpukit_lib IN LISTS CMAKE_DL_LIBS)
    string(APPEND gpukit_pc_system_libs " -l${gpukit_lib}")
  endforeach()
  configure_file("${CMAKE_CURRENT_LIST_DIR}/gpukit.pc.in" "${gpukit_package_dir}/gpukit.pc" @ONLY)
  install(FILES "${gpukit_package_dir}/gpukit.pc"
    DESTINATION "${GPUKIT_INSTALL_PKGCONFIGDIR}"
    COMPONENT gpukit)
else()
  message(STATUS "gpukit: no CUDA toolkit found: gpukit.pc is not installed (it records the toolkit's paths); the "
                 "CMake package does not need them")
endif()

# --- license -------------------------------------------------------------------------------------------------------
# Not CMAKE_INSTALL_DOCDIR: inside a parent project that is share/doc/<parent>, and two LICENSE files would collide.
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE"
  DESTINATION "${CMAKE_INSTALL_DATADIR}/doc/gpukit"
  COMPONENT gpukit)
