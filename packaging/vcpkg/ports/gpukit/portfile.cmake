vcpkg_from_github(
    OUT_SOURCE_PATH SOURCE_PATH
    REPO gpukit/gpukit
    REF "v${VERSION}"
    SHA512 4c132eff7e36ddc439d042b01ded7b5a4f0e9e0503d6712b6e83fc3f41b0404e80727d9b3aec070cba4de8c2b7a763260ff619bb77ddf221995b7b30598e39f4
    HEAD_REF main
)

vcpkg_check_features(OUT_FEATURE_OPTIONS feature_options FEATURES compiled GPUKIT_BUILD_COMPILED)
vcpkg_check_linkage(ONLY_STATIC_LIBRARY) # gpukit::compiled is libgpukit.a
set(VCPKG_BUILD_TYPE release) # the headers, and libgpukit.a built once

include("${CURRENT_INSTALLED_DIR}/share/cuda/vcpkg_find_cuda.cmake")
vcpkg_find_cuda(OUT_CUDA_TOOLKIT_ROOT cuda_toolkit_root)

vcpkg_cmake_configure(
    SOURCE_PATH "${SOURCE_PATH}"
    OPTIONS
        -DGPUKIT_BUILD_TESTS=OFF
        -DGPUKIT_BUILD_EXAMPLES=OFF
        -DGPUKIT_BUILD_BENCHMARKS=OFF
        ${feature_options}
        -DGPUKIT_INSTALL=ON
        "-DGPUKIT_INSTALL_PKGCONFIGDIR=${CURRENT_BUILDTREES_DIR}/not-packaged" # CMake package only
        "-DCUDAToolkit_ROOT=${cuda_toolkit_root}"
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(CONFIG_PATH share/cmake/gpukit)

file(REMOVE_RECURSE
    "${CURRENT_PACKAGES_DIR}/share/cmake"
    "${CURRENT_PACKAGES_DIR}/share/doc"
)
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
