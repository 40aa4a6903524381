# Header-only: the headers, a CMake package made from the project's own template, and the
# license. The project builds with Meson; nothing here needs it, so the port does not run it.
set(VCPKG_BUILD_TYPE release)

vcpkg_from_github(
    OUT_SOURCE_PATH SOURCE_PATH
    REPO tierstate/tierstate
    REF "v${VERSION}"
    # The archive of tag v0.1.0, once it is made (tests/packaging/vcpkg.sh checks it then).
    SHA512 00000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000
    HEAD_REF main
)

# The C API's header (tierstate/c.h) goes with its library, which this port does not build.
file(INSTALL "${SOURCE_PATH}/include/tierstate" DESTINATION "${CURRENT_PACKAGES_DIR}/include" PATTERN "c.h" EXCLUDE)

# The same tierstateConfig.cmake that `meson install` writes: tierstate::tierstate, with
# xsimd, liburing and libxxhash found through pkg-config.
include(CMakePackageConfigHelpers)
set(INCLUDEDIR include)
set(LIBDIR lib)
configure_package_config_file(
    "${SOURCE_PATH}/include/cmake/tierstate-config.cmake.in"
    "${CURRENT_PACKAGES_DIR}/share/${PORT}/tierstateConfig.cmake"
    INSTALL_DESTINATION "share/${PORT}"
)
write_basic_package_version_file(
    "${CURRENT_PACKAGES_DIR}/share/${PORT}/tierstateConfigVersion.cmake"
    VERSION "${VERSION}"
    COMPATIBILITY SameMinorVersion
    ARCH_INDEPENDENT
)
# tierstate_add_host_kernels(), which tierstateConfig.cmake includes: the host kernels
# dispatched at run time (README "Portable builds").
file(INSTALL "${SOURCE_PATH}/include/cmake/tierstate-kernels.cmake" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_cmake_config_fixup()

file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
