#!/usr/bin/env bash
# gpu-check: accel's whole toolchain on a GPU machine, or (--cpu) the same checks on the CPU, as
# one PASS/FAIL table. Three uses:
#
#   scripts/gpu-check.sh --pack DIR
#       On the Debian 12 build machine, after scripts/build.sh: copies accel-launch (with the
#       accel-launch-cluster it runs for several machines), accel and accel-agent into DIR/bin,
#       every library they load that is not glibc's or the C++ runtime's into DIR/lib (their
#       RPATH is $ORIGIN/../lib, so DIR can go anywhere), and the headers a pip libtorch lacks
#       (gloo, xxhash, nlohmann-json) into DIR/include.
#   scripts/gpu-check.sh --launcher DIR
#       On the GPU machine: builds libaccel, accel-check, the examples, bench_train and
#       device_checks against python3's PyTorch (its libtorch, CUDA and NCCL) into build-gpu/, then
#       runs the checks with DIR's launcher binaries.
#       The checks run on one GPU: the first of CUDA_VISIBLE_DEVICES, else GPU 0.
#   scripts/gpu-check.sh --cpu --build build
#       The same checks on the CPU with an existing build (the tests run this, with --quick).
#
# Other options: --build DIR (use an existing build: no build step), --out DIR (logs; default a
# new temporary folder), --no-bench, --quick (shorter training and benchmark runs).
# Exit status: 0 when every check passed, 1 when one failed, 2 on bad arguments or no build.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

MODE=gpu BUILD="" LAUNCHER="" OUT="" BENCH=1 QUICK=0 PACK=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --build) BUILD="$2"; shift ;;
    --launcher) LAUNCHER="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    --no-bench) BENCH=0 ;;
    --quick) QUICK=1 ;;
    --pack) PACK="$2"; shift ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# --- --pack: relocatable launcher binaries and the headers a pip libtorch lacks -----------------
if [ -n "$PACK" ]; then
  bin="${BUILD:-$ROOT/build}/bin"
  command -v patchelf >/dev/null || { echo "gpu-check: --pack needs patchelf (scripts/install-deps.sh installs it)" >&2; exit 2; }
  mkdir -p "$PACK/bin" "$PACK/lib" "$PACK/include" "$PACK/share/cmake" || exit 2
  for b in accel-launch accel-launch-cluster accel accel-agent; do
    [ -x "$bin/$b" ] || { echo "gpu-check: $bin/$b is missing: run scripts/build.sh first" >&2; exit 2; }
    install -m 0755 "$bin/$b" "$PACK/bin/$b" && strip "$PACK/bin/$b"
    # Why not glibc and libstdc++/libgcc: every Linux has them, and a newer one runs what an
    # older one built; everything else (gRPC, protobuf, abseil, yaml-cpp, fmt, ...) travels.
    ldd "$bin/$b" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
      case "$(basename "$lib")" in
        libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libresolv.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
        *) [ -e "$PACK/lib/$(basename "$lib")" ] || install -m 0644 "$lib" "$PACK/lib/$(basename "$lib")" ;;
      esac
    done
    patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$PACK/bin/$b"
  done
  for lib in "$PACK"/lib/*.so*; do patchelf --force-rpath --set-rpath '$ORIGIN' "$lib"; done
  cp -r /usr/include/gloo /usr/include/nlohmann "$PACK/include/" &&
    cp /usr/include/xxhash.h "$PACK/include/" &&
    cp -r /usr/share/cmake/nlohmann_json "$PACK/share/cmake/" || exit 2
  echo "gpu-check: packed $(ls "$PACK/bin" | wc -l) programs, $(ls "$PACK/lib" | wc -l) libraries" \
       "and headers into $PACK ($(du -sh "$PACK" | cut -f1))"
  exit 0
fi

# --- the build ---------------------------------------------------------------------------------
PY=""
for p in ${ACCEL_PYTHON:-} python3 /usr/bin/python3; do
  if "$p" -c 'import torch' 2>/dev/null; then PY="$p"; break; fi
done
if [ -z "$BUILD" ]; then
  [ -n "$PY" ] || { echo "gpu-check: no python3 with torch to build against (set ACCEL_PYTHON)" >&2; exit 2; }
  BUILD="$ROOT/build-gpu"
  torch_dir="$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))')"
  extra=()
  if [ -n "$LAUNCHER" ] && [ -d "$LAUNCHER/include" ]; then
    # Why CPLUS_INCLUDE_PATH: searched after libtorch's own include folders, so a libtorch that
    # ships gloo keeps its own headers.
    export CPLUS_INCLUDE_PATH="$LAUNCHER/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
    extra+=(-DCMAKE_PREFIX_PATH="$LAUNCHER")
  fi
  # NCCL's header: the CUDA toolkit's, else the nvidia-nccl wheel's beside torch.
  nccl_inc="$("$PY" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)"
  [ -n "$nccl_inc" ] && [ -f "$nccl_inc/nccl.h" ] && export CPLUS_INCLUDE_PATH="${CPLUS_INCLUDE_PATH:+$CPLUS_INCLUDE_PATH:}$nccl_inc"
  echo "gpu-check: building against $torch_dir into $BUILD"
  start=$SECONDS
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DACCEL_BUILD_CONTROL_PLANE=OFF \
        -DACCEL_BUILD_TESTS=OFF -DACCEL_BUILD_EXAMPLES=ON -DACCEL_BUILD_BENCHMARKS=ON \
        -DTorch_DIR="$torch_dir/share/cmake/Torch" "${extra[@]}" >"$BUILD.configure.log" 2>&1 ||
    { tail -30 "$BUILD.configure.log"; echo "gpu-check: configure failed" >&2; exit 2; }
  # -k 0: every error of the build at once, not only the first file's.
  cmake --build "$BUILD" -j "$(nproc)" --target accel-check device_checks train_classifier bench_train \
        -- -k 0 >"$BUILD.build.log" 2>&1 ||
    { grep -A3 'error:' "$BUILD.build.log" | head -60; echo "gpu-check: build failed" >&2; exit 2; }
  echo "gpu-check: built in $((SECONDS - start)) s"
fi
B="$BUILD/bin"
for p in accel-check device_checks train_classifier bench_train; do
  [ -x "$B/$p" ] || { echo "gpu-check: $B/$p is missing (build it, or drop --build)" >&2; exit 2; }
done
L="${LAUNCHER:+$LAUNCHER/bin}"
L="${L:-$B}"
[ -x "$L/accel-launch" ] || { echo "gpu-check: no accel-launch in $L (give --launcher DIR)" >&2; exit 2; }
# accel test runs the accel-check beside accel: the one built against this machine's libtorch.
[ "$L/accel-check" -ef "$B/accel-check" ] || cp "$B/accel-check" "$L/accel-check" || exit 2

# Why one GPU: the checks expect what one GPU gives (NCCL for one rank, gloo for two sharing it);
# on a machine with several they run on the first visible one. On the CPU every program is told
# so, also where a GPU is visible.
if [ "$MODE" = gpu ]; then
  first_gpu="${CUDA_VISIBLE_DEVICES:-0}"
  export CUDA_VISIBLE_DEVICES="${first_gpu%%,*}"
else
  export ACCEL_USE_CPU=1
fi
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")}"
mkdir -p "$OUT" || exit 2
W="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-work-XXXXXX")" || exit 2
trap 'rm -rf "$W"' EXIT
export ACCEL_PROGRESS=off

NAMES=() RESULTS=() DETAILS=()
row() {
  NAMES+=("$1") RESULTS+=("$2") DETAILS+=("$3")
  printf 'gpu-check: %-4s %s: %s\n' "$2" "$1" "$3"
}
# run NAME SECONDS CMD...: runs CMD with its output in $OUT/NAME.log; sets RC.
run() {
  local name="$1" limit="$2"; shift 2
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  RC=$?
}
last_line() { grep -v '^\s*$' "$1" | tail -1 | cut -c1-150; }

# 1. The launcher binaries start here (their libraries travel with them).
run versions 20 bash -c "'$L/accel-launch' --version && '$L/accel' --version && '$L/accel-agent' --version"
if [ $RC -eq 0 ]; then row "launcher binaries run" PASS "$(tr '\n' ' ' <"$OUT/versions.log")"
else row "launcher binaries run" FAIL "$(last_line "$OUT/versions.log")"; fi

# 2. libtorch, and the GPU where one is expected.
run info 60 "$B/accel-check" --info
torch_line="$(grep -m1 -- '- version:' "$OUT/info.log" | sed 's/^- //')"
cuda_line="$(grep -m1 -- '- CUDA:' "$OUT/info.log" | sed 's/^- //')"
if [ $RC -eq 0 ] && { [ "$MODE" = cpu ] || grep -q 'CUDA: available' "$OUT/info.log"; }; then
  row "libtorch and device" PASS "libtorch $torch_line; $cuda_line"
else row "libtorch and device" FAIL "$(last_line "$OUT/info.log")"; fi

# 3. accel env (what a bug report needs) runs.
run env 60 "$L/accel" env
if [ $RC -eq 0 ]; then row "accel env" PASS "$(grep -m1 -i -E 'GPU|CUDA' "$OUT/env.log" | cut -c1-120)"
else row "accel env" FAIL "exit $RC: $(last_line "$OUT/env.log")"; fi

# 4-5. accel test: one rank (a process group of one: NCCL on a GPU) and two ranks (on one GPU
# they share it, so gloo carries CUDA tensors).
if [ "$MODE" = gpu ]; then one="(nccl, cuda:0)" two="(gloo, cuda:0)"; else one="(gloo, cpu)" two="(shared memory, cpu)"; fi
for n in 1 2; do
  expect="$one"; [ $n -eq 2 ] && expect="$two"
  run "accel-test-$n" 240 "$L/accel" test -n "$n"
  coll="$(grep -m1 'collectives' "$OUT/accel-test-$n.log" | tr -s ' ' | cut -c1-160)"
  if [ $RC -eq 0 ] && grep -qF "$expect" "$OUT/accel-test-$n.log"; then
    row "accel test -n $n" PASS "every row PASS; $coll"
  else row "accel test -n $n" FAIL "exit $RC, expected collectives $expect: $(last_line "$OUT/accel-test-$n.log")"; fi
done

# 6. What cannot work is refused with a message: NCCL where ranks share a GPU (on the CPU: NCCL
# at all).
if [ "$MODE" = gpu ]; then refusal="NCCL needs a GPU of its own"; else refusal="ACCEL_BACKEND=nccl needs a GPU"; fi
run nccl-refused 120 env ACCEL_BACKEND=nccl ACCEL_CHECK_DIR="$W/check-nccl" "$L/accel-launch" -n 2 -- "$B/accel-check"
if [ $RC -ne 0 ] && grep -qF "$refusal" "$OUT/nccl-refused.log"; then
  row "ACCEL_BACKEND=nccl refused clearly" PASS "exit $RC: $(grep -m1 -o 'ACCEL_BACKEND=nccl.*' "$OUT/nccl-refused.log" | cut -c1-110)..."
else row "ACCEL_BACKEND=nccl refused clearly" FAIL "exit $RC, no '$refusal': $(last_line "$OUT/nccl-refused.log")"; fi

# 7. Two ranks train to the weights of one process on the global batch (3840 samples: whole
# batches of 64, so both see the same batches).
epochs=3; [ $QUICK -eq 1 ] && epochs=2
CLS=("$B/train_classifier" --epochs "$epochs" --train-samples 3840 --seed 1)
TOL=1e-4
run train-1 300 "$L/accel-launch" -n 1 -- "${CLS[@]}" --batch-size 64 --save-model "$W/w1"
rc1=$RC
run train-2 300 "$L/accel-launch" -n 2 -- "${CLS[@]}" --batch-size 32 --save-model "$W/w2"
rc2=$RC
run compare-2 60 "$B/device_checks" compare-weights "$W/w1/model.safetensors" "$W/w2/model.safetensors" "$TOL"
if [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && [ $RC -eq 0 ]; then
  row "2 ranks train to the 1-process weights" PASS "$(last_line "$OUT/compare-2.log"); $(grep -m1 -o 'eval_accuracy [0-9.]*' "$OUT/train-2.log" | tail -1)"
else row "2 ranks train to the 1-process weights" FAIL "exits $rc1/$rc2/$RC: $(last_line "$OUT/compare-2.log")"; fi

# 8. A rank SIGKILLed mid-run: the group restarts, resumes, and ends on the weights of the run that
# was never killed. Three ways to resume: a checkpoint written during the step, one written by a
# background thread (--async-checkpoints: the GPU state is copied to host memory during the call),
# and the node's in-memory snapshot (--snapshot-interval: /dev/shm, no checkpoint folder).
# kill_and_resume NAME TITLE WAIT EXPECT FLAGS...: launches 2 ranks with FLAGS, SIGKILLs one once
# WAIT (a function, given NAME; it and a_worker see kill_and_resume's $bounded) succeeds, and passes when the
# job succeeded, resumed from something matching EXPECT before the last step, and ended within
# TOL of the unkilled run's weights.
# Why ten times the samples of check 7: a kill that polls for a file lands some 0.1-0.3 s after it
# appears, and 120 steps of this model take about that long; 1200 leave the kill mid-run. The
# unkilled run of the same length is the reference.
KCLS=("$B/train_classifier" --epochs "$epochs" --train-samples 38400 --seed 1 --batch-size 32)
run train-2-long 300 "$L/accel-launch" -n 2 -- "${KCLS[@]}" --save-model "$W/w2-long"
rc_long=$RC
# A worker of the job that timeout ($bounded) runs: timeout's child is the launcher, whose
# children are the workers.
a_worker() { pgrep -P "$(pgrep -P "$bounded" | head -1)" 2>/dev/null | head -1; }
first_checkpoint() { compgen -G "$W/$1/checkpoints/checkpoint_*" >/dev/null; }
# The snapshot folder is private to the job: the workers are told it in ACCEL_SNAPSHOT_DIR, read
# once (a poll must be cheap: on the CPU a --quick job lasts a second or two).
first_snapshot() {
  if [ -z "$snapshot_dir" ]; then
    local worker
    worker="$(a_worker)"
    [ -n "$worker" ] || return 1
    snapshot_dir="$(tr '\0' '\n' 2>/dev/null <"/proc/$worker/environ" | sed -n 's/^ACCEL_SNAPSHOT_DIR=//p')"
    [ -n "$snapshot_dir" ] || return 1
  fi
  compgen -G "$snapshot_dir/checkpoint_*" >/dev/null
}
kill_and_resume() {
  local name="$1" title="$2" ready="$3" expect="$4" limit=300; shift 4
  [ $QUICK -eq 1 ] && limit=120
  snapshot_dir=""
  timeout -k 5 "$limit" "$L/accel-launch" --max-restarts 2 "$@" \
    -n 2 -- "${KCLS[@]}" --save-model "$W/w-$name" >"$OUT/$name.log" 2>&1 &
  local bounded=$! killed="" victim rck resumed
  for _ in $(seq 1 1200); do
    if "$ready" "$name"; then
      victim="$(a_worker)"
      [ -n "$victim" ] && kill -9 "$victim" 2>/dev/null && killed="$victim"
      break
    fi
    kill -0 "$bounded" 2>/dev/null || break
    sleep 0.02
  done
  wait "$bounded"; rck=$?
  run "compare-$name" 60 "$B/device_checks" compare-weights "$W/w2-long/model.safetensors" "$W/w-$name/model.safetensors" "$TOL"
  resumed="$(grep -m1 -o 'resumed from .*' "$OUT/$name.log" | sed 's|^resumed from ||; s|/dev/shm/accel-snapshots-[^/]*/||; s|.*/checkpoints/||' | cut -c1-70)"
  # Why "took no optimizer step" fails: a kill that landed after the last step resumed nothing.
  if [ $rc_long -eq 0 ] && [ -n "$killed" ] && [ $rck -eq 0 ] && grep -qE "resumed from $expect" "$OUT/$name.log" &&
     ! grep -q "took no optimizer step" "$OUT/$name.log" && [ $RC -eq 0 ]; then
    row "$title" PASS "pid $killed SIGKILLed, resumed from $resumed; $(last_line "$OUT/compare-$name.log")"
  else row "$title" FAIL "reference exit $rc_long, killed '${killed:-none}', exit $rck, resumed '${resumed:-no}' (expected '$expect'): $(last_line "$OUT/compare-$name.log")"; fi
}
kill_and_resume kill-resume "killed rank restarts and resumes" first_checkpoint "/.*/checkpoint_" \
  --checkpoint-dir "$W/kill-resume" --checkpoint-interval 100
kill_and_resume kill-resume-async "... from a background save" first_checkpoint "/.*/checkpoint_" \
  --checkpoint-dir "$W/kill-resume-async" --checkpoint-interval 100 --async-checkpoints
kill_and_resume kill-resume-snapshot "... from an in-memory snapshot" first_snapshot "the in-memory snapshot " \
  --snapshot-interval 5

# 9. Two launchers (two "machines" of one rank each on this host) meet through the gRPC
# coordinator and run accel-check. Why gloo on a GPU: both ranks would share the one GPU, which
# NCCL refuses, and each launcher sees only its own rank.
port=$((20000 + RANDOM % 12000))  # below the ephemeral ports (32768 and up)
for m in 0 1; do
  timeout -k 5 180 env ACCEL_TOKEN=gpu-check-token-of-32-characters-long ACCEL_BACKEND=gloo \
    ACCEL_CHECK_DIR="$W/check-machines" "$L/accel-launch" --nodes 2 \
    --machine-rank $m -n 1 --coordinator-port "$port" -- "$B/accel-check" >"$OUT/two-machines-$m.log" 2>&1 &
  pids[$m]=$!
done
wait "${pids[0]}"; rm0=$?
wait "${pids[1]}"; rm1=$?
passes="$(grep -c $'ACCEL-CHECK\t0\t.*\tPASS' "$OUT/two-machines-0.log")"
if [ $rm0 -eq 0 ] && [ $rm1 -eq 0 ] && [ "$passes" -eq 4 ]; then
  row "2 machines meet over gRPC (--nodes 2)" PASS "$(grep -m1 -o 'RANK 0..1, .*' "$OUT/two-machines-0.log" | cut -c1-100)"
else row "2 machines meet over gRPC (--nodes 2)" FAIL "exits $rm0/$rm1, $passes of 4 checks passed: $(last_line "$OUT/two-machines-0.log")"; fi

# 10. Mixed precision never runs the forward pass on stale weight copies, whichever backward the
# program calls (fp16 needs CUDA).
precisions="bf16"; [ "$MODE" = gpu ] && precisions="bf16 fp16"
for p in $precisions; do
  for how in plain accel; do
    run "stale-$p-$how" 120 "$B/device_checks" stale-weights "$p" "$how"
    if [ $RC -eq 0 ]; then row "$p, $how backward: no stale weights" PASS "$(last_line "$OUT/stale-$p-$how.log" | sed 's/.*steps, //')"
    else row "$p, $how backward: no stale weights" FAIL "$(last_line "$OUT/stale-$p-$how.log")"; fi
  done
done

# 11. Training speed against PyTorch on the same libtorch, one process: model M (784-2048-2048-10
# MLP, batch 64) and model L (train_lm's transformer, 16 x 64 tokens), fp32 and bf16.
if [ $BENCH -eq 1 ]; then
  steps=1000 warmup=50 device=cuda
  [ $QUICK -eq 1 ] && steps=20 warmup=3
  [ "$MODE" = cpu ] && device=cpu
  table=() ok=1
  field() { sed -n "s/.*\"$2\": \"\{0,1\}\([^,\"}]*\).*/\1/p" "$OUT/$1.log" | tail -1; }
  for model in M L; do
    for prec in no bf16; do
      # Why fewer: bf16 on a CPU without native bf16 runs model M at ~1 step/s; --quick on the CPU
      # only checks that this part of the script runs.
      run_steps=$steps run_warmup=$warmup
      [ $QUICK -eq 1 ] && [ "$MODE" = cpu ] && [ "$prec" = bf16 ] && run_steps=4 run_warmup=1
      run "bench-accel-$model-$prec" 300 env ACCEL_MIXED_PRECISION="$prec" "$B/bench_train" --model "$model" --steps "$run_steps" --warmup "$run_warmup"
      a_rc=$RC
      if [ -n "$PY" ]; then
        run "bench-torch-$model-$prec" 300 "$PY" "$ROOT/bench/train/ddp_bench.py" --model "$model" --device "$device" --mixed-precision "$prec" --steps "$run_steps" --warmup "$run_warmup"
      else RC=127; echo "no python3 with torch" >"$OUT/bench-torch-$model-$prec.log"; fi
      t_rc=$RC
      a="$(field "bench-accel-$model-$prec" steps_per_s)" t="$(field "bench-torch-$model-$prec" steps_per_s)"
      at="$(field "bench-accel-$model-$prec" tokens_per_s)" tt="$(field "bench-torch-$model-$prec" tokens_per_s)"
      dev="$(field "bench-accel-$model-$prec" device)"
      if [ $a_rc -ne 0 ] || [ $t_rc -ne 0 ] || [ -z "$a" ] || [ -z "$t" ] || [ "$dev" != "${device/cuda/cuda:0}" ]; then ok=0; fi
      ratio="$(awk -v a="${a:-0}" -v t="${t:-0}" 'BEGIN { if (t > 0) printf "%.2fx", a / t; else print "-" }')"
      table+=("$(printf '| %s | %s | %s | %s | %s | %s | %s |' "$model" "${prec/no/fp32}" "${a:-failed}" "${t:-failed}" "$ratio" "${at:-}" "${tt:-}")")
    done
  done
  counted="$steps steps each"
  [ $QUICK -eq 1 ] && [ "$MODE" = cpu ] && counted="$steps steps each (bf16: 4)"
  if [ $ok -eq 1 ]; then row "benchmark against PyTorch ($device)" PASS "$counted, table below"
  else row "benchmark against PyTorch ($device)" FAIL "a run failed or ran elsewhere: see $OUT/bench-*.log"; fi
fi

# --- the table ----------------------------------------------------------------------------------
echo
gpus="$(nvidia-smi -L 2>/dev/null | head -1)"
echo "gpu-check ($MODE) on $(hostname): $(nproc) CPU cores${gpus:+, $gpus}"
failed=0
printf '%-44s %s\n' "check" "result"
for i in "${!NAMES[@]}"; do
  printf '%-44s %s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${DETAILS[$i]}"
  [ "${RESULTS[$i]}" = PASS ] || failed=$((failed + 1))
done
if [ $BENCH -eq 1 ]; then
  echo
  echo "| model | precision | accel steps/s | PyTorch steps/s | accel / PyTorch | accel tokens/s | PyTorch tokens/s |"
  echo "|---|---|---|---|---|---|---|"
  printf '%s\n' "${table[@]}"
fi
echo
echo "$(( ${#NAMES[@]} - failed )) passed, $failed failed (logs in $OUT)"
[ $failed -eq 0 ]
