#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Conan 2 route, end to end and offline:
#   1. `conan create` of the root conanfile.py (this checkout, exports_sources), which builds
#      and runs recipes/tierstate/all/test_package;
#   2. `conan create` of the Conan Center recipe (recipes/tierstate/all) from the archive that
#      GitHub would serve for this checkout, with its own test_package;
#   3. tests/packaging/consumer built through CMakeDeps the way a user would, and run;
#   4. the packages' files checked (headers and licence only), and the two recipes' CMakeDeps
#      output compared;
#   5. the Conan Center recipe with the option c_api (libtierstate_c, built by src/CMakeLists.txt):
#      its test_package's C program run, its files and exports checked;
#   6. with the option tools (tierstate-plan, built by the same file): the test_package runs it by
#      name (the run environment's PATH), its files checked.
# Conan Center cannot be reached here, so xsimd, liburing and xxhash are the system's, through
# the test-only */system recipes in tests/conan and the profile's [replace_requires].
#
#   conan.sh SOURCE_DIR [WORK_DIR]    (WORK_DIR: a fresh temporary one, removed at exit)
# Environment: TIERSTATE_CONAN_VENV (default ~/.cache/tierstate/conan-venv; made if missing).
# Exit 77 (skip) when pkg-config, cmake or Python's venv module is missing.
set -euo pipefail

conan_pin="conan==2.34.0"
src=$(cd "${1:?usage: conan.sh SOURCE_DIR [WORK_DIR]}" && pwd)
if [[ $# -ge 2 ]]; then
  mkdir -p "$2"
  work=$(cd "$2" && pwd)
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi

for tool in pkg-config cmake python3; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIP: $tool is not installed"
    exit 77
  fi
done
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  echo "SKIP: python3's venv module (Debian: python3-venv) is not installed"
  exit 77
fi

# Each part prints its name; its time is printed when the next starts, and all at the end.
timings=()
part_name=""
part_start=0
script_start=$(date +%s.%N)
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
part() {
  if [[ -n $part_name ]]; then
    local t
    t=$(elapsed "$part_start")
    timings+=("$(printf '%7s s  %s' "$t" "$part_name")")
    echo "-- $part_name: $t s"
  fi
  part_name=$1
  part_start=$(date +%s.%N)
  [[ -n $part_name ]] && echo "== $part_name"
  return 0
}

version=$(cat "$src/VERSION")
# shellcheck source=tests/packaging/c_library.sh
source "$src/tests/packaging/c_library.sh"
soversion=$(c_soversion "$version")
jobs=2

part "Conan in a virtual environment"
venv=${TIERSTATE_CONAN_VENV:-$HOME/.cache/tierstate/conan-venv}
if [[ ! -x $venv/bin/conan ]]; then
  echo "making $venv with $conan_pin"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "$conan_pin"
fi
conan=$venv/bin/conan
conan_version=$("$conan" --version)
echo "$conan_version ($venv)"
if [[ $conan_version != "Conan version 2."* ]]; then
  echo "FAIL: $venv has $conan_version; this needs Conan 2 (remove the folder to remake it)"
  exit 1
fi

part "Conan home and profile (no remotes)"
export CONAN_HOME=$work/conan-home
"$conan" profile detect --force
# The default remote would be tried for anything missing; nothing may come from outside.
if "$conan" remote list | grep -q '^conancenter'; then
  "$conan" remote remove conancenter
fi
for dep in xsimd liburing xxhash; do
  "$conan" export "$src/tests/conan/$dep"
done
cat > "$CONAN_HOME/profiles/ci" <<EOF
include(default)
[settings]
compiler.cppstd=20
[replace_requires]
xsimd/*: xsimd/system
liburing/*: liburing/system
xxhash/*: xxhash/system
[conf]
tools.build:jobs=$jobs
# The system's pkg-config for src/CMakeLists.txt (the recipe would take pkgconf from Conan Center)
tools.gnu:pkg_config=pkg-config
EOF
profiles=(-pr:h ci -pr:b ci)
# The newest tierstate/VERSION package as REVISION:PACKAGE_ID (the one just created).
newest_package() {
  "$conan" list "tierstate/$version#latest:*" --format=json | "$venv/bin/python" -c '
import json, sys
for ref in json.load(sys.stdin)["Local Cache"].values():
    for rrev, info in ref.get("revisions", {}).items():
        print(rrev + ":" + next(iter(info.get("packages", {})), "NONE"))'
}
# Only this run's two recipe revisions (a reused work dir keeps its cache).
"$conan" remove "tierstate/*" --confirm >/dev/null

part "conan create of the development recipe (conanfile.py), with its test_package"
# The test_package's build folder goes to the work dir, not into the checkout.
"$conan" create "$src" "${profiles[@]}" --build=missing \
  --test-folder recipes/tierstate/all/test_package \
  -c "tools.cmake.cmake_layout:test_folder=$work/test-package-development" \
  -c "tools.cmake.cmaketoolchain:user_presets="
development=$(newest_package)

part "archive as GitHub would serve it, and the Conan Center recipe pointed at it"
center=$work/center-recipe
rm -rf "$center"
cp -r "$src/recipes/tierstate/all" "$center"
if ! grep -q "^  \"$version\":" "$src/recipes/tierstate/config.yml"; then
  echo "FAIL: recipes/tierstate/config.yml does not list $version"
  exit 1
fi
archive=$work/tierstate-$version.tar.gz
if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  # `git stash create` commits the uncommitted changes to tracked files without touching the
  # checkout or the stash list; with none it prints nothing.
  rev=$(git -C "$src" stash create || true)
  rev=${rev:-HEAD}
  echo "archive of $(git -C "$src" rev-parse --short "$rev") ($([[ $rev == HEAD ]] && echo HEAD || echo 'HEAD and uncommitted changes'))"
  git -C "$src" archive --format=tar --prefix="tierstate-$version/" "$rev" | gzip -n > "$archive"
else
  echo "not a git checkout: an archive of its include/, LICENSE and VERSION"
  tar -C "$src" --transform "s|^|tierstate-$version/|" -cf - include LICENSE VERSION | gzip -n > "$archive"
fi
sha=$(sha256sum "$archive" | cut -d' ' -f1)
"$venv/bin/python" - "$center/conandata.yml" "$version" "file://$archive" "$sha" <<'EOF'
import sys
import yaml
path, version, url, sha256 = sys.argv[1:]
with open(path) as f:
    data = yaml.safe_load(f)
if version not in data.get("sources", {}):
    sys.exit(f"FAIL: conandata.yml has no sources for {version}")
data["sources"] = {version: {"url": url, "sha256": sha256}}
with open(path, "w") as f:
    yaml.safe_dump(data, f, default_flow_style=False)
print(f"conandata.yml: {version} from {url} (sha256 {sha256})")
EOF

part "conan create of the Conan Center recipe (recipes/tierstate/all), with its test_package"
"$conan" create "$center" --version "$version" "${profiles[@]}" --build=missing \
  -c "tools.cmake.cmake_layout:test_folder=$work/test-package-center" \
  -c "tools.cmake.cmaketoolchain:user_presets="
center_package=$(newest_package)

part "tests/packaging/consumer through CMakeDeps (the Conan Center recipe's package)"
consumer=$work/consumer-build
"$conan" install --requires="tierstate/$version" "${profiles[@]}" --build=missing \
  -g CMakeDeps -g CMakeToolchain -g VirtualRunEnv --output-folder "$consumer/conan"
cmake -S "$src/tests/packaging/consumer" -B "$consumer" \
  -DCMAKE_TOOLCHAIN_FILE="$consumer/conan/conan_toolchain.cmake" -DCMAKE_BUILD_TYPE=Release
cmake --build "$consumer" -j "$jobs"
# NvmeFile's scratch file goes in the work dir (O_DIRECT where the filesystem has it).
# shellcheck disable=SC1091  # (written by conan install above)
(source "$consumer/conan/conanrun.sh" && "$consumer/consumer" "$work" && "$consumer/dispatch_consumer" | tail -n 1)

part "the packages' files, and the two recipes' CMakeDeps output compared"
expected=$work/expected-files
(cd "$src/include" && find tierstate -type f \( -name '*.hpp' -o -name '*.inl' \) | sort) > "$expected"
# Anything else there is not packaged: say so, as it may be meant to be.
others=$(cd "$src/include" && find tierstate -type f ! -name '*.hpp' ! -name '*.inl')
[[ -z $others ]] || echo "note: not packaged (neither .hpp nor .inl):" "$others"
problems=0
if [[ $development == "$center_package" ]]; then
  echo "FAIL: the two recipes made one recipe revision ($development); expected two"
  problems=$((problems + 1))
fi
declare -A package_of=([development]=$development [center]=$center_package) folder_of=()
for which in development center; do
  folder=$("$conan" cache path "tierstate/$version#${package_of[$which]}")
  folder_of[$which]=$folder
  echo "$which recipe: tierstate/$version#${package_of[$which]} in $folder"
  (cd "$folder/include" && find . -type f | sed 's|^\./||' | sort) > "$work/package-files"
  if ! diff -u "$expected" "$work/package-files"; then
    echo "FAIL: its include/ differs from the checkout's include/tierstate headers (above)"
    problems=$((problems + 1))
  fi
  if ! cmp -s "$src/LICENSE" "$folder/licenses/LICENSE"; then
    echo "FAIL: licenses/LICENSE is missing or is not the checkout's LICENSE"
    problems=$((problems + 1))
  fi
  [[ -f $folder/include/tierstate/tierstate.hpp ]] || { echo "FAIL: no include/tierstate/tierstate.hpp"; problems=$((problems + 1)); }
  unexpected=$(cd "$folder" && find . -mindepth 1 -maxdepth 1 ! -name include ! -name licenses ! -name lib \
    ! -name conaninfo.txt ! -name conanmanifest.txt)
  unexpected+=$(cd "$folder" && find . \( -name '*.cmake' -o -name '*.cmake.in' -o -name '*.pc' \) \
    ! -path ./lib/cmake/tierstate-kernels.cmake -printf '\n%p')
  unexpected+=$(cd "$folder" && find ./lib -type f ! -path ./lib/cmake/tierstate-kernels.cmake -printf '\n%p')
  if ! cmp -s "$src/include/cmake/tierstate-kernels.cmake" "$folder/lib/cmake/tierstate-kernels.cmake"; then
    echo "FAIL: lib/cmake/tierstate-kernels.cmake (tierstate_add_host_kernels' build module) is missing or differs"
    problems=$((problems + 1))
  fi
  if [[ -n $unexpected ]]; then
    echo "FAIL: the package has files it should not (a header-only package: headers, licence, and"
    echo "tierstate_add_host_kernels' build module):"
    echo "$unexpected"
    problems=$((problems + 1))
  fi
done
# Same package_info: CMakeDeps writes the same tierstate files for each, up to the folder.
for which in development center; do
  out=$work/cmakedeps-$which
  rm -rf "$out"
  if ! "$conan" install --requires="tierstate/$version#${package_of[$which]%%:*}" "${profiles[@]}" \
      -g CMakeDeps --output-folder "$out" > "$work/cmakedeps-$which.log" 2>&1; then
    cat "$work/cmakedeps-$which.log"
    exit 1
  fi
  mkdir -p "$out/normalized"
  for f in "$out"/tierstate*.cmake; do
    sed "s|${folder_of[$which]}|PACKAGE_FOLDER|g" "$f" > "$out/normalized/$(basename "$f")"
  done
done
if diff -ru "$work/cmakedeps-development/normalized" "$work/cmakedeps-center/normalized"; then
  echo "both recipes give the same CMakeDeps files:" \
    "$(cd "$work/cmakedeps-center/normalized" && echo tierstate*)"
else
  echo "FAIL: the two recipes' CMakeDeps files differ (above)"
  problems=$((problems + 1))
fi
# package_info's requires and system_libs, as CMakeDeps turned them into CMake.
data=$(cat "$work/cmakedeps-center"/tierstate-*-data.cmake)
for wanted in "set(tierstate_FIND_DEPENDENCY_NAMES xsimd liburing xxHash)" \
              "set(tierstate_SYSTEM_LIBS_RELEASE pthread)"; do
  if [[ $data == *"$wanted"* ]]; then
    echo "CMakeDeps: $wanted"
  else
    echo "FAIL: CMakeDeps' tierstate data has no '$wanted'"
    problems=$((problems + 1))
  fi
done
[[ $problems -eq 0 ]] || exit 1

part "the Conan Center recipe with the option c_api (libtierstate_c), with its test_package"
"$conan" create "$center" --version "$version" "${profiles[@]}" --build=missing -o "tierstate/*:c_api=True" \
  -c "tools.cmake.cmake_layout:test_folder=$work/test-package-c-api" \
  -c "tools.cmake.cmaketoolchain:user_presets=" 2>&1 | tee "$work/c-api.log"
grep -q "^libtierstate_c $version (.* kernels): one AdamW step.*: ok" "$work/c-api.log" ||
  { echo "FAIL: the test_package's C program did not run (no 'libtierstate_c $version' line above)"; exit 1; }
c_package=$("$conan" list "tierstate/$version#latest:*" --format=json | "$venv/bin/python" -c '
import json, sys
for ref in json.load(sys.stdin)["Local Cache"].values():
    for rrev, info in ref.get("revisions", {}).items():
        for pid, package in info.get("packages", {}).items():
            if package.get("info", {}).get("options", {}).get("c_api") == "True":
                print(rrev + ":" + pid)')
[[ -n $c_package ]] || { echo "FAIL: no tierstate package with c_api=True"; exit 1; }
folder=$("$conan" cache path "tierstate/$version#$c_package")
for f in include/tierstate/c.h include/tierstate/tierstate.hpp lib/libtierstate_c.so \
         "lib/libtierstate_c.so.$soversion" "lib/libtierstate_c.so.$version" lib/cmake/tierstate-kernels.cmake \
         licenses/LICENSE; do
  [[ -e $folder/$f ]] || { echo "FAIL: the c_api package has no $f"; exit 1; }
done
[[ ! -e $folder/lib/pkgconfig ]] || { echo "FAIL: the c_api package has lib/pkgconfig (PkgConfigDeps writes it)"; exit 1; }
check_c_exports "$folder/lib/libtierstate_c.so" "$src/include/tierstate/c.h" "$work"

part "the Conan Center recipe with the option tools (tierstate-plan, headers beside it), with its test_package"
"$conan" create "$center" --version "$version" "${profiles[@]}" --build=missing -o "tierstate/*:tools=True" \
  -c "tools.cmake.cmake_layout:test_folder=$work/test-package-tools" \
  -c "tools.cmake.cmaketoolchain:user_presets=" 2>&1 | tee "$work/tools.log"
# The test_package calls it by name: the run environment's PATH must hold it.
grep -q "^1.3e+10 parameters, bf16 params" "$work/tools.log" ||
  { echo "FAIL: the test_package did not run tierstate-plan (no '1.3e+10 parameters' line above)"; exit 1; }
tools_package=$("$conan" list "tierstate/$version#latest:*" --format=json | "$venv/bin/python" -c '
import json, sys
for ref in json.load(sys.stdin)["Local Cache"].values():
    for rrev, info in ref.get("revisions", {}).items():
        for pid, package in info.get("packages", {}).items():
            o = package.get("info", {}).get("options", {})
            if o.get("tools") == "True" and o.get("c_api") != "True":
                print(rrev + ":" + pid)')
[[ -n $tools_package ]] || { echo "FAIL: no tierstate package with tools=True alone"; exit 1; }
folder=$("$conan" cache path "tierstate/$version#$tools_package")
for f in bin/tierstate-plan include/tierstate/tierstate.hpp licenses/LICENSE; do
  [[ -e $folder/$f ]] || { echo "FAIL: the tools package has no $f"; exit 1; }
done
[[ ! -e $folder/lib/libtierstate_c.so ]] || { echo "FAIL: the tools package has libtierstate_c (c_api was off)"; exit 1; }

part ""
echo "== times"
printf '%s\n' "${timings[@]}"
printf '%7s s  total\n' "$(elapsed "$script_start")"
echo "conan.sh: ok ($conan_version; tierstate $version from both recipes)"
