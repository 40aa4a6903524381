#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's demo reaches the same losses, step for step, with its state on NVMe (the
# default: NvmeFile + Pipelined<2>, in a fresh directory or --path DIR) and in PinnedHost.
#   demo_tiers_agree.sh BUILT_CHAR_MLP SCRATCH_PARENT
set -euo pipefail
demo=$1
parent=$2
dir=$(mktemp -d "$parent/demo-nvme-XXXXXX")
trap 'rm -rf "$dir"' EXIT
"$demo" --steps 120 --tier nvme --path "$dir" >"$dir.nvme.txt"
"$demo" --steps 120 --tier pinned >"$dir.pinned.txt"
trap 'rm -rf "$dir" "$dir.nvme.txt" "$dir.pinned.txt"' EXIT
grep -q 'in NvmeFile' "$dir.nvme.txt"
grep -q 'in PinnedHost' "$dir.pinned.txt"
losses() { grep '^step' "$1" | awk '{print $1, $2, $3, $4, $5, $6}'; }
if ! diff <(losses "$dir.nvme.txt") <(losses "$dir.pinned.txt"); then
  echo "the demo's losses differ between NvmeFile and PinnedHost"
  exit 1
fi
[ -z "$(ls -A "$dir")" ] || { echo "the demo left files in $dir:"; ls -la "$dir"; exit 1; }
echo "NvmeFile and PinnedHost: the same losses over $(losses "$dir.nvme.txt" | wc -l) reported steps"
losses "$dir.nvme.txt" | tail -1
