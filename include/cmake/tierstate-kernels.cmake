# SPDX-License-Identifier: Apache-2.0
# tierstate_add_host_kernels(<target> <source>...): runtime dispatch of the host kernels
# (tierstate/kernels/host/dispatch.hpp) for a CMake project. Each source defines a
# host_kernels list's units (TIERSTATE_HOST_KERNEL_UNIT, kernels/host/dispatch_unit.hpp); it is
# compiled once per x86-64 level (x86-64-v2, v3, v4 and v4-bf16; elsewhere once, with the
# project's flags) into a static library of its own, linked into <target> after the target's
# own objects, narrowest first. <target> itself is built with the project's flags (for a
# binary that runs on every x86-64: -march=x86-64, or none). The units are linked with
# target_link_libraries' keyword signature (PRIVATE), which the target's other calls must use.
#   find_package(tierstate REQUIRED)
#   add_executable(trainer trainer.cpp)
#   target_link_libraries(trainer PRIVATE tierstate::tierstate)
#   tierstate_add_host_kernels(trainer my_kernels.cpp)
# Included by tierstate's CMake package (and, for Conan, as a build module).
function(tierstate_add_host_kernels target)
  if(NOT TARGET ${target})
    message(FATAL_ERROR "tierstate_add_host_kernels: ${target} is not a target")
  endif()
  if(NOT ARGN)
    message(FATAL_ERROR "tierstate_add_host_kernels(${target}): name the sources that define its kernel units")
  endif()
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    message(FATAL_ERROR "tierstate_add_host_kernels: the kernel units take GCC's and Clang's -march flags; "
      "${CMAKE_CXX_COMPILER_ID} is neither")
  endif()
  if(TARGET ${target}_tierstate_kernels_build OR TARGET ${target}_tierstate_kernels_x86_64_v2)
    message(FATAL_ERROR "tierstate_add_host_kernels(${target}) was called before: give all of its kernel sources "
      "in one call")
  endif()
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
    set(levels x86_64_v2 x86_64_v3 x86_64_v4 x86_64_v4_bf16)
    set(flags_x86_64_v2 -march=x86-64-v2 -DTIERSTATE_HOST_KERNEL_LEVEL=2)
    set(flags_x86_64_v3 -march=x86-64-v3 -DTIERSTATE_HOST_KERNEL_LEVEL=3)
    set(flags_x86_64_v4 -march=x86-64-v4 -DTIERSTATE_HOST_KERNEL_LEVEL=4)
    set(flags_x86_64_v4_bf16 -march=x86-64-v4 -mavx512bf16 -mavx512vbmi -mavx512ifma -DTIERSTATE_HOST_KERNEL_LEVEL=5)
    # GCC 12's own AVX-512 headers warn of uninitialized reads (GCC bug 105593, fixed in 13)
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
      list(APPEND flags_x86_64_v4 -Wno-uninitialized -Wno-maybe-uninitialized)
      list(APPEND flags_x86_64_v4_bf16 -Wno-uninitialized -Wno-maybe-uninitialized)
    endif()
  else()
    set(levels build)
    set(flags_build -DTIERSTATE_HOST_KERNEL_LEVEL=0)
  endif()
  foreach(level IN LISTS levels)
    set(unit ${target}_tierstate_kernels_${level})
    add_library(${unit} STATIC ${ARGN})
    # Optimized whatever the build type: kernels are their speed, and xsimd 8.1's AVX-512BW
    # code does not compile at -O0.
    target_compile_options(${unit} PRIVATE -O3 ${flags_${level}})
    target_link_libraries(${unit} PRIVATE tierstate::tierstate)
    # Hidden, as Meson builds them: a shared library's units stay its own.
    set_target_properties(${unit} PROPERTIES POSITION_INDEPENDENT_CODE ON CXX_VISIBILITY_PRESET hidden
      VISIBILITY_INLINES_HIDDEN ON)
    target_link_libraries(${target} PRIVATE ${unit})
  endforeach()
endfunction()
