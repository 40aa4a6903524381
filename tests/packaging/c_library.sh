# SPDX-License-Identifier: Apache-2.0
# What vcpkg.sh and conan.sh check of a packaged libtierstate_c (sourced, after `set -euo pipefail`).

# c_soversion VERSION: the soname's version, major.minor until 1.0, then the major (src/meson.build)
c_soversion() {
  if [[ ${1%%.*} == 0 ]]; then echo "${1%.*}"; else echo "${1%%.*}"; fi
}

# check_c_exports LIBRARY C_H WORK_DIR: the library exports c.h's functions and nothing else
check_c_exports() {
  nm -D --defined-only "$1" | awk '{ print $3 }' | sort > "$3/exported"
  sed -nE 's/^TIERSTATE_C_EXPORT .*[ *](tierstate_[a-z0-9_]+)\(.*/\1/p' "$2" | sort > "$3/declared"
  if ! diff -u "$3/declared" "$3/exported"; then
    echo "FAIL: $1 exports other than c.h's functions (above: - declared only, + exported only)"
    return 1
  fi
  echo "$(basename "$1") exports c.h's $(wc -l < "$3/declared") functions and nothing else"
}
