#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Checks the vcpkg port (ports/tierstate) with the offline vcpkg in ../shared/vcpkg:
#   1. `vcpkg format-manifest` leaves vcpkg.json as it is;
#   2. `x-add-version` accepts the port in a scratch git registry;
#   3. the unchanged portfile installs tierstate from the archive GitHub would serve for the
#      commit under test (made here with git archive; only its SHA512 is rewritten), with the
#      registry's xsimd 14 and liburing;
#   4. a CMake consumer (find_package + tierstate::tierstate, -Wall -Wextra -Werror) trains
#      with PinnedHost and NvmeFile and checks the result;
#   5. with the feature c-api: libtierstate_c installed, exporting c.h's functions and nothing
#      else, its kernel units checked by check_isa.py, and C consumers (CMake's
#      tierstate::tierstate_c and pkg-config's tierstate-c) built with -Werror and run at
#      each x86-64 level the CPU has;
#   6. with the feature tools (beside c-api, Release and Debug): tierstate-plan in
#      tools/tierstate, run.
#   vcpkg.sh SOURCE_DIR [WORK_DIR]
# Exits 77 (skip), saying why, only where the offline vcpkg or a tool is missing.
set -euo pipefail
src=$(cd "$1" && pwd)
vcpkg_dir=${TIERSTATE_VCPKG:-$src/../shared/vcpkg}
if [ ! -f "$vcpkg_dir/env.sh" ]; then
  echo "SKIP: no offline vcpkg at $vcpkg_dir (set TIERSTATE_VCPKG to its folder)"
  exit 77
fi
for tool in cmake ninja git pkg-config patchelf; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool is not installed (apt-get install $tool)"; exit 77; }
done
if [ $# -ge 2 ]; then work=$2; mkdir -p "$work"; else work=$(mktemp -d); trap 'rm -rf "$work"' EXIT; fi
work=$(cd "$work" && pwd)
version=$(cat "$src/VERSION")
# shellcheck source=tests/packaging/c_library.sh
source "$src/tests/packaging/c_library.sh"
soversion=$(c_soversion "$version")
t0=$SECONDS
part() { echo "== $1 (at ${SECONDS}s)"; }

# shellcheck disable=SC1091
source "$vcpkg_dir/env.sh" "$work/vcpkg" >/dev/null

part "format-manifest leaves ports/tierstate/vcpkg.json unchanged"
rm -rf "$work/fmt" && mkdir -p "$work/fmt" && cp -r "$src/ports/tierstate" "$work/fmt/"
vcpkg format-manifest "$work/fmt/tierstate/vcpkg.json" >/dev/null
diff -u "$src/ports/tierstate/vcpkg.json" "$work/fmt/tierstate/vcpkg.json"

part "x-add-version in a scratch registry"
reg=$work/registry
rm -rf "$reg" && mkdir -p "$reg/ports" "$reg/versions"
cp -r "$src/ports/tierstate" "$reg/ports/"
echo '{"default": {}}' > "$reg/versions/baseline.json"
git -C "$reg" init -q
git -C "$reg" add -A
git -C "$reg" -c user.name=ci -c user.email=ci@invalid commit -qm "tierstate port"
vcpkg --x-builtin-ports-root="$reg/ports" --x-builtin-registry-versions-dir="$reg/versions" \
  x-add-version tierstate >/dev/null
tree=$(git -C "$reg" rev-parse HEAD:ports/tierstate)
grep -q "\"git-tree\": \"$tree\"" "$reg/versions/t-/tierstate.json"
grep -q "\"baseline\": \"$version\"" "$reg/versions/baseline.json"
echo "versions/t-/tierstate.json names git-tree $tree, version $version"

part "install from the archive of the commit under test"
# A checkout with uncommitted edits archives them too (git stash create), so that this
# checks what is on disk; in CI, a clean clone, that is HEAD.
rev=$(git -C "$src" stash create || true)
rev=${rev:-HEAD}
archive=$VCPKG_DOWNLOADS/tierstate-tierstate-v$version.tar.gz
git -C "$src" archive --format=tar --prefix="tierstate-v$version/" "$rev" | gzip -n > "$archive"
sha=$(sha512sum "$archive" | cut -d' ' -f1)
if git -C "$src" rev-parse -q --verify "refs/tags/v$version" >/dev/null; then
  # Once the release is tagged, the port must name that archive.
  tagged=$(git -C "$src" archive --format=tar --prefix="tierstate-v$version/" "v$version" | gzip -n | sha512sum | cut -d' ' -f1)
  grep -q "SHA512 $tagged" "$src/ports/tierstate/portfile.cmake" ||
    { echo "ports/tierstate/portfile.cmake: SHA512 is not that of tag v$version's archive ($tagged)"; exit 1; }
fi
overlay=$work/overlay
rm -rf "$overlay" && mkdir -p "$overlay" && cp -r "$src/ports/tierstate" "$overlay/"
sed -i -E "s/SHA512 [0-9a-f]{128}/SHA512 $sha/" "$overlay/tierstate/portfile.cmake"
grep -q "SHA512 $sha" "$overlay/tierstate/portfile.cmake"
vcpkg install tierstate --overlay-ports="$overlay" --overlay-ports="$TIERSTATE_VCPKG_SYSTEM_PORTS" \
  > "$work/install.log" 2>&1 || { tail -40 "$work/install.log"; exit 1; }
grep -E "^(The package|tierstate provides)" "$work/install.log" || true

part "the installed files"
installed=$VCPKG_ROOT/installed/x64-linux-release
list=$VCPKG_ROOT/installed/vcpkg/info/tierstate_${version}_x64-linux-release.list
for f in include/tierstate/tierstate.hpp share/tierstate/tierstateConfig.cmake \
         share/tierstate/tierstateConfigVersion.cmake share/tierstate/copyright share/tierstate/usage; do
  grep -qx "x64-linux-release/$f" "$list" || { echo "the port did not install $f"; exit 1; }
done
if grep -x "x64-linux-release/include/tierstate/c.h" "$list"; then
  echo "the port installs the C API's header, and not its library"; exit 1
fi
if grep -E "^x64-linux-release/(lib|debug|bin)/" "$list"; then
  echo "a header-only port installs no lib/, debug/ or bin/"; exit 1
fi
if grep -rl "$src\|$work/vcpkg/buildtrees" "$installed/share/tierstate"; then
  echo "the CMake package names an absolute build path"; exit 1
fi
echo "$(grep -c '\.hpp$' "$list") headers; no lib/; copyright and usage installed"

part "a CMake consumer through vcpkg's toolchain"
cmake -S "$src/tests/packaging/consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_TOOLCHAIN_FILE="$VCPKG_ROOT/scripts/buildsystems/vcpkg.cmake" \
  -DVCPKG_TARGET_TRIPLET=x64-linux-release -DVCPKG_MANIFEST_MODE=OFF > "$work/consumer.log" 2>&1 ||
  { cat "$work/consumer.log"; exit 1; }
cmake --build "$work/consumer" >> "$work/consumer.log" 2>&1 || { cat "$work/consumer.log"; exit 1; }
"$work/consumer/consumer" "$work" | tee "$work/consumer.out"
"$work/consumer/dispatch_consumer" | tail -n 1
# It must have compiled against vcpkg's xsimd (14), not the system's (Debian's 8.1).
xsimd=$(basename "$(ls "$VCPKG_ROOT"/installed/vcpkg/info/xsimd_*_x64-linux-release.list)" | cut -d_ -f2)
grep -q "with xsimd ${xsimd%.*}:" "$work/consumer.out" || { echo "the consumer did not use vcpkg's xsimd $xsimd"; exit 1; }
part "feature c-api: libtierstate_c"
vcpkg install "tierstate[c-api]" --recurse --overlay-ports="$overlay" --overlay-ports="$TIERSTATE_VCPKG_SYSTEM_PORTS" \
  > "$work/install-c.log" 2>&1 || { tail -40 "$work/install-c.log"; exit 1; }
for f in include/tierstate/c.h lib/libtierstate_c.so lib/libtierstate_c.so.$soversion \
         lib/libtierstate_c.so.$version lib/pkgconfig/tierstate-c.pc share/tierstate/tierstateConfig.cmake; do
  grep -qx "x64-linux-release/$f" "$list" || { echo "the port with c-api did not install $f"; exit 1; }
done
library=$installed/lib/libtierstate_c.so
check_c_exports "$library" "$src/include/tierstate/c.h" "$work"
# The build's own objects and kernel units, as check_isa.py reads them (tests/meson.build's c_api_isa).
built=$VCPKG_ROOT/buildtrees/tierstate/x64-linux-release-rel
rm -f "$work/tierstate_c_own.a"
ar rc "$work/tierstate_c_own.a" "$built"/CMakeFiles/tierstate_c.dir/*.o
python3 "$src/tests/c/check_isa.py" --may-share-none "$(command -v objdump)" "$(command -v nm)" "$library" \
  "$work/tierstate_c_own.a" "$built"/libtierstate_c_tierstate_kernels_x86_64_v{2,3,4,4_bf16}.a
cmake -S "$src/tests/install/cmake_c" -B "$work/consumer-c" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DEXPECTED_VERSION="$version" -DCMAKE_TOOLCHAIN_FILE="$VCPKG_ROOT/scripts/buildsystems/vcpkg.cmake" \
  -DVCPKG_TARGET_TRIPLET=x64-linux-release -DVCPKG_MANIFEST_MODE=OFF > "$work/consumer-c.log" 2>&1 &&
  cmake --build "$work/consumer-c" >> "$work/consumer-c.log" 2>&1 || { cat "$work/consumer-c.log"; exit 1; }
# shellcheck disable=SC2046
cc -std=c11 -Wall -Wextra -Werror -pedantic "$src/tests/install/consumer.c" -o "$work/consumer-c-pc" \
  -DEXPECTED_VERSION="\"$version\"" $(PKG_CONFIG_LIBDIR=$installed/lib/pkgconfig pkg-config --cflags --libs tierstate-c)
for level in "" x86-64-v2 x86-64-v3 x86-64-v4 x86-64-v4-bf16; do
  for consumer in "$work/consumer-c/consumer_c" "$work/consumer-c-pc"; do
    if out=$(TIERSTATE_ARCH=$level LD_LIBRARY_PATH=$installed/lib "$consumer" 2>&1); then
      echo "TIERSTATE_ARCH=${level:-(unset)} $(basename "$consumer"): $out"
      [[ -z $level || $out == *"($level kernels)"* ]] || { echo "it did not run the $level kernels"; exit 1; }
    elif [[ $out == *"this CPU cannot run"* ]]; then
      echo "TIERSTATE_ARCH=$level: this CPU lacks it ($out)"
    else
      echo "$consumer with TIERSTATE_ARCH=$level failed: $out"; exit 1
    fi
  done
done
part "features c-api and tools for x64-linux (vcpkg's default triplet: Release and Debug)"
vcpkg install "tierstate[c-api,tools]:x64-linux" --overlay-ports="$overlay" --overlay-ports="$TIERSTATE_VCPKG_SYSTEM_PORTS" \
  > "$work/install-c-debug.log" 2>&1 || { tail -40 "$work/install-c-debug.log"; exit 1; }
list_x64=$VCPKG_ROOT/installed/vcpkg/info/tierstate_${version}_x64-linux.list
for f in lib/libtierstate_c.so debug/lib/libtierstate_c.so debug/lib/pkgconfig/tierstate-c.pc; do
  grep -qx "x64-linux/$f" "$list_x64" || { echo "the port with c-api for x64-linux did not install $f"; exit 1; }
done
if grep -E "^x64-linux/debug/(include|share)/" "$list_x64"; then echo "debug/include or debug/share installed"; exit 1; fi
# The feature tools: tierstate-plan in tools/tierstate (vcpkg_copy_tools), no bin/ left.
grep -qx "x64-linux/tools/tierstate/tierstate-plan" "$list_x64" ||
  { echo "the port with tools did not install tools/tierstate/tierstate-plan"; exit 1; }
if grep -E "^x64-linux/(debug/)?bin/" "$list_x64"; then echo "bin/ installed beside tools/"; exit 1; fi
plan_lines=$("$VCPKG_ROOT/installed/x64-linux/tools/tierstate/tierstate-plan" --params 13B --no-probe --json | grep -c '^{"plan":')
[ "$plan_lines" = 4 ] || { echo "vcpkg's tierstate-plan printed $plan_lines compositions, not 4"; exit 1; }
echo "tools/tierstate/tierstate-plan: $plan_lines compositions for 13B"
cmake -S "$src/tests/install/cmake_c" -B "$work/consumer-c-debug" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DEXPECTED_VERSION="$version" -DCMAKE_TOOLCHAIN_FILE="$VCPKG_ROOT/scripts/buildsystems/vcpkg.cmake" \
  -DVCPKG_TARGET_TRIPLET=x64-linux -DVCPKG_MANIFEST_MODE=OFF > "$work/consumer-c-debug.log" 2>&1 &&
  cmake --build "$work/consumer-c-debug" -v >> "$work/consumer-c-debug.log" 2>&1 ||
  { cat "$work/consumer-c-debug.log"; exit 1; }
grep -q "x64-linux/debug/lib/libtierstate_c.so" "$work/consumer-c-debug.log" ||
  { echo "the Debug consumer did not link debug/lib/libtierstate_c.so"; exit 1; }
echo "Debug consumer (linked x64-linux/debug/lib/libtierstate_c.so): $("$work/consumer-c-debug/consumer_c")"
echo "vcpkg: passed in $((SECONDS - t0)) s"
