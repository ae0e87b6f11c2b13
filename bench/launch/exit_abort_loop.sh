#!/usr/bin/env bash
# How often HF Accelerate's test scripts fail under accel-launch and (with --torchrun) under
# torchrun, by failure signature. It measures PyTorch's Gloo abort at interpreter exit
# ("terminate called without an active exception"; see docs/launch.md), which a launcher can
# make more or less likely but not remove. With --torchrun the two launchers alternate run by
# run, so a busier or quieter stretch of the machine falls on both alike.
#
#   bench/launch/exit_abort_loop.sh ACCELERATE_SRC RUNS [--torchrun] [SCRIPT ...]
#
# ACCELERATE_SRC: an HF Accelerate source tree (e.g. `git archive v0.32.1` of
# huggingface/accelerate). Empty huggingface_hub/safetensors stubs are made for it (they are not
# Debian packages); python3-packaging, python3-psutil and python3-yaml must be installed.
# SCRIPT defaults to test_ops.py; "test_ops.py+destroy" is test_ops.py with
# torch.distributed.destroy_process_group() at the end of main().
# ACCEL_LAUNCH_ARGS: extra accel-launch flags (split on spaces), for A/B runs of its options.
set -euo pipefail
src=$(cd "$1" && pwd) runs=$2
shift 2
torchrun=0
if [ "${1:-}" = "--torchrun" ]; then torchrun=1; shift; fi
scripts=("${@:-test_ops.py}")
here=$(cd "$(dirname "$0")/../.." && pwd)
launch=$here/build/bin/accel-launch
read -r -a extra <<<"${ACCEL_LAUNCH_ARGS:-}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/stubs/huggingface_hub/utils" "$work/stubs/safetensors"
printf 'def model_info(*a, **k): raise NotImplementedError\ndef split_torch_state_dict_into_shards(*a, **k): raise NotImplementedError\n' \
  >"$work/stubs/huggingface_hub/__init__.py"
printf 'class GatedRepoError(Exception): pass\nclass RepositoryNotFoundError(Exception): pass\n' \
  >"$work/stubs/huggingface_hub/utils/__init__.py"
printf 'def safe_open(*a, **k): raise NotImplementedError\n' >"$work/stubs/safetensors/__init__.py"
printf 'def load_file(*a, **k): raise NotImplementedError\ndef save_file(*a, **k): raise NotImplementedError\n' \
  >"$work/stubs/safetensors/torch.py"
export PYTHONPATH=$src/src:$work/stubs
keep=${ACCEL_BENCH_KEEP:-$(mktemp -d /tmp/exit_abort_loop.XXXXXX)}  # the failed runs' output
mkdir -p "$keep"
dir=$src/src/accelerate/test_utils/scripts

launchers=(accel-launch)
[ "$torchrun" = 1 ] && launchers+=(torchrun)
declare -A failed aborts
# One run of script file $2 under launcher $1; counts its failure and keeps its output.
run_once() {
  local l=$1 file=$2 key=$3 rc
  set +e
  if [ "$l" = accel-launch ]; then
    timeout -s KILL 300 "$launch" -n 2 "${extra[@]}" /usr/bin/python3 "$file" >"$work/out" 2>&1
    rc=$?
  else
    # Why cat: accel-launch reads its workers' output through pipes; torchrun's workers write
    # to its stdout, made a pipe here so both are measured alike.
    # Why --redirects/--tee 9:0 (rank 9 does not exist: nothing is redirected): torch 1.13's
    # torchrun fails without them on Python 3.11 (None.get in its argument parsing).
    timeout -s KILL 300 /usr/bin/python3 -m torch.distributed.run --nproc_per_node 2 \
      --redirects 9:0 --tee 9:0 --monitor_interval 0.1 "$file" 2>&1 | cat >"$work/out"
    rc=${PIPESTATUS[0]}
  fi
  set -e
  if [ "$rc" -ne 0 ]; then
    failed[$key]=$((failed[$key] + 1))
    cp "$work/out" "$keep/$l-${key//\//_}-${failed[$key]}.log"
    if grep -q "terminate called without an active exception" "$work/out"; then
      aborts[$key]=$((aborts[$key] + 1))
    fi
  fi
}

echo "| launcher | script | runs | failed | Gloo exit abort | other |"
echo "|---|---|---:|---:|---:|---:|"
for s in "${scripts[@]}"; do
  file=$dir/${s%+destroy}
  if [ "$s" != "${s%+destroy}" ]; then
    sed 's/^    test_copy_tensor_to_devices(state)$/&\n    torch.distributed.destroy_process_group()/' "$file" >"$work/destroy.py"
    file=$work/destroy.py
  fi
  for l in "${launchers[@]}"; do failed[$l/$s]=0 aborts[$l/$s]=0; done
  for _ in $(seq 1 "$runs"); do
    for l in "${launchers[@]}"; do run_once "$l" "$file" "$l/$s"; done
  done
  for l in "${launchers[@]}"; do
    k=$l/$s
    echo "| $l${extra[*]:+ ${extra[*]}} | $s | $runs | ${failed[$k]} | ${aborts[$k]} | $((failed[$k] - aborts[$k])) |"
  done
done
echo "output of the failed runs: $keep"
