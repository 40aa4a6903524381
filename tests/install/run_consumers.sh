#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs tierstate into a temporary prefix, runs the installed tierstate-plan, and builds the
# tiny consumer three ways:
# pkg-config, CMake find_package, and a Meson subproject; and the C consumer through
# pkg-config and CMake's tierstate::tierstate_c. Exits 77 (skip) only when a tool
# the test needs is missing, saying which.
#   run_consumers.sh SOURCE_DIR CXX
set -euo pipefail
src=$1
cxx=$2
for tool in cmake pkg-config meson ninja; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIP: $tool is not installed (apt-get install $tool)"
    exit 77
  fi
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

echo "== meson install into $prefix"
CXX=$cxx meson setup "$work/build" "$src" --prefix="$prefix" -Dtests=false -Dbenchmarks=false \
  -Dexamples=false -Dcuda=disabled -Doptimization=0 >/dev/null
meson install -C "$work/build" >/dev/null
pc=$(dirname "$(find "$prefix" -name tierstate.pc | head -1)")
cm=$(dirname "$(find "$prefix" -name tierstateConfig.cmake | head -1)")
echo "installed: $(find "$prefix" -name '*.hpp' | wc -l) headers, $pc/tierstate.pc, $cm/tierstateConfig.cmake"

echo "== tierstate-plan, installed in bindir"
plan_lines=$("$prefix/bin/tierstate-plan" --params 1B --no-probe --json | grep -c '^{"plan":')
[ "$plan_lines" = 4 ] || { echo "the installed tierstate-plan printed $plan_lines compositions, not 4"; exit 1; }
"$prefix/bin/tierstate-plan" --params 13B --no-probe | sed -n 1,2p

# VERSION, the one source of the version: what pkg-config, CMake and the headers say of it.
version=$(cat "$src/VERSION")

echo "== pkg-config"
pc_version=$(PKG_CONFIG_PATH=$pc pkg-config --modversion tierstate)
[ "$pc_version" = "$version" ] || { echo "tierstate.pc says version $pc_version, VERSION $version"; exit 1; }
# shellcheck disable=SC2046
"$cxx" -O2 -Wall -Wextra -Werror "$src/tests/install/consumer.cpp" -o "$work/consumer_pc" -DEXPECTED_VERSION="\"$version\"" \
  $(PKG_CONFIG_PATH=$pc pkg-config --cflags --libs tierstate)
"$work/consumer_pc"

echo "== C, pkg-config tierstate-c (libtierstate_c)"
cc=${CC:-gcc}
lib=$(dirname "$(find "$prefix" -name 'libtierstate_c.so' | head -1)")
# shellcheck disable=SC2046
# Only tierstate's .pc files on the path (PKG_CONFIG_LIBDIR): a C program needs none of the
# C++ headers' dependencies.
"$cc" -std=c11 -Wall -Wextra -Werror -pedantic "$src/tests/install/consumer.c" -o "$work/consumer_c" \
  -DEXPECTED_VERSION="\"$version\"" $(PKG_CONFIG_LIBDIR=$pc pkg-config --cflags --libs tierstate-c)
LD_LIBRARY_PATH=$lib "$work/consumer_c"

echo "== CMake tierstate_add_host_kernels (the host kernels dispatched at run time)"
CXX=$cxx cmake -S "$src/tests/install/cmake_dispatch" -B "$work/cmake_dispatch" -DCMAKE_PREFIX_PATH="$prefix" \
  >/dev/null
cmake --build "$work/cmake_dispatch" --parallel 2 >/dev/null
"$work/cmake_dispatch/dispatch_consumer" | tail -n 1

echo "== CMake find_package"
CXX=$cxx cmake -S "$src/tests/install/cmake" -B "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix" \
  -DEXPECTED_VERSION="$version" >/dev/null
cmake --build "$work/cmake" --parallel 2 >/dev/null
"$work/cmake/consumer"
LD_LIBRARY_PATH=$lib "$work/cmake/consumer_c"
# The C API alone (COMPONENTS c), with a PKG_CONFIG_PATH that holds none of the C++
# dependencies' .pc files: it must not look for them.
PKG_CONFIG_LIBDIR=/nonexistent cmake -S "$src/tests/install/cmake_c" -B "$work/cmake_c" -DCMAKE_PREFIX_PATH="$prefix" \
  -DEXPECTED_VERSION="$version" >/dev/null
cmake --build "$work/cmake_c" --parallel 2 >/dev/null
LD_LIBRARY_PATH=$lib "$work/cmake_c/consumer_c"

echo "== Meson subproject"
mkdir -p "$work/sub/subprojects"
cp "$src/tests/install/meson/meson.build" "$src/tests/install/consumer.cpp" "$work/sub/"
cp -r "$src/tests/dispatch" "$work/sub/dispatch"
sed -i "s|'../consumer.cpp'|'consumer.cpp'|" "$work/sub/meson.build"
ln -s "$(cd "$src" && pwd)" "$work/sub/subprojects/tierstate"
CXX=$cxx meson setup "$work/sub/build" "$work/sub" --werror -Dwarning_level=2 -Dtierstate:tests=false \
  -Dtierstate:benchmarks=false -Dtierstate:examples=false -Dtierstate:cuda=disabled -Dtierstate:capi=false >/dev/null
meson compile -C "$work/sub/build" >/dev/null
"$work/sub/build/consumer"
"$work/sub/build/dispatch_consumer" | tail -n 1
echo "all the consumers built and ran"
