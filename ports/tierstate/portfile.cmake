# The headers, a CMake package made from the project's own template, and the license; with
# the feature c-api, also libtierstate_c (tierstate/c.h), and with the feature tools the program
# tierstate-plan (tools/), both built by src/CMakeLists.txt (the project builds with Meson, which
# a port cannot run here; that file builds the same library and program).
if("c-api" IN_LIST FEATURES)
    # A shared library only, as Meson builds it: its kernel units are linked after its own
    # code, narrowest first (src/meson.build says why), an order that a static archive would
    # leave to each program's link.
    vcpkg_check_linkage(ONLY_DYNAMIC_LIBRARY)
else()
    set(VCPKG_BUILD_TYPE release) # header-only, or headers and a program
endif()

vcpkg_from_github(
    OUT_SOURCE_PATH SOURCE_PATH
    REPO tierstate/tierstate
    REF "v${VERSION}"
    # The archive of tag v0.1.0, once it is made (tests/packaging/vcpkg.sh checks it then).
    SHA512 00000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000
    HEAD_REF main
)

vcpkg_check_features(OUT_FEATURE_OPTIONS feature_options FEATURES c-api TIERSTATE_C_API tools TIERSTATE_PLAN)
if("c-api" IN_LIST FEATURES OR "tools" IN_LIST FEATURES)
    vcpkg_find_acquire_program(PKGCONFIG)  # xsimd, liburing and libxxhash are found with it
    vcpkg_cmake_configure(SOURCE_PATH "${SOURCE_PATH}/src"
        OPTIONS "-DPKG_CONFIG_EXECUTABLE=${PKGCONFIG}" ${feature_options})
    vcpkg_cmake_install()  # lib/libtierstate_c.so*, include/tierstate/c.h, tierstate-c.pc; bin/tierstate-plan
    if("c-api" IN_LIST FEATURES)
        vcpkg_fixup_pkgconfig()
    endif()
    if("tools" IN_LIST FEATURES)
        vcpkg_copy_tools(TOOL_NAMES tierstate-plan AUTO_CLEAN)  # tools/tierstate/tierstate-plan
    endif()
    file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug/include")
endif()
# The C API's header (tierstate/c.h) goes with its library: only with the feature c-api.
file(INSTALL "${SOURCE_PATH}/include/tierstate" DESTINATION "${CURRENT_PACKAGES_DIR}/include" PATTERN "c.h" EXCLUDE)

# The same tierstateConfig.cmake that `meson install` writes: tierstate::tierstate, with
# xsimd, liburing and libxxhash found through pkg-config.
# It defines tierstate::tierstate_c where the library is there (lib/, and debug/lib/ for a
# Debug build). Written for each configuration built (vcpkg_cmake_config_fixup wants a
# debug/share/tierstate where there is a debug build; it keeps the release one).
include(CMakePackageConfigHelpers)
set(INCLUDEDIR include)
set(LIBDIR lib)
set(config_roots "${CURRENT_PACKAGES_DIR}")
if(NOT DEFINED VCPKG_BUILD_TYPE)
    list(APPEND config_roots "${CURRENT_PACKAGES_DIR}/debug")
endif()
foreach(config_root IN LISTS config_roots)
    configure_package_config_file(
        "${SOURCE_PATH}/include/cmake/tierstate-config.cmake.in"
        "${config_root}/share/${PORT}/tierstateConfig.cmake"
        INSTALL_DESTINATION "share/${PORT}"
        INSTALL_PREFIX "${config_root}"
    )
endforeach()
if("c-api" IN_LIST FEATURES OR "tools" IN_LIST FEATURES)
    set(arch_independent "")  # libtierstate_c or tierstate-plan is built for this triplet
else()
    set(arch_independent ARCH_INDEPENDENT)
endif()
write_basic_package_version_file(
    "${CURRENT_PACKAGES_DIR}/share/${PORT}/tierstateConfigVersion.cmake"
    VERSION "${VERSION}"
    COMPATIBILITY SameMinorVersion
    ${arch_independent}
)
# tierstate_add_host_kernels(), which tierstateConfig.cmake includes: the host kernels
# dispatched at run time (README "Portable builds").
file(INSTALL "${SOURCE_PATH}/include/cmake/tierstate-kernels.cmake" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_cmake_config_fixup()

file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
