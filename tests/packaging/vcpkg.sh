#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Checks the vcpkg port (ports/tierstate) with the offline vcpkg in ../shared/vcpkg:
#   1. `vcpkg format-manifest` leaves vcpkg.json as it is;
#   2. `x-add-version` accepts the port in a scratch git registry;
#   3. the unchanged portfile installs tierstate from the archive GitHub would serve for the
#      commit under test (made here with git archive; only its SHA512 is rewritten), with the
#      registry's xsimd 14 and liburing;
#   4. a CMake consumer (find_package + tierstate::tierstate, -Wall -Wextra -Werror) trains
#      with PinnedHost and NvmeFile and checks the result.
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
echo "vcpkg: passed in $((SECONDS - t0)) s"
