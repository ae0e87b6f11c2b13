#!/usr/bin/env bash
# How often HF Accelerate's test scripts fail under accel-launch (and, with --torchrun, under
# torchrun with the workers' output through a pipe), by failure signature. It measures PyTorch's
# Gloo abort at interpreter exit ("terminate called without an active exception"; see
# docs/launch.md), which a launcher can make more or less likely but not remove.
#
#   bench/launch/exit_abort_loop.sh ACCELERATE_SRC RUNS [--torchrun] [SCRIPT ...]
#
# ACCELERATE_SRC: an HF Accelerate source tree (e.g. `git archive v0.32.1` of
# huggingface/accelerate). Empty huggingface_hub/safetensors stubs are made for it (they are not
# Debian packages); python3-packaging, python3-psutil and python3-yaml must be installed.
# SCRIPT defaults to test_ops.py; "test_ops.py+destroy" is test_ops.py with
# torch.distributed.destroy_process_group() at the end of main().
set -euo pipefail
src=$(cd "$1" && pwd) runs=$2
shift 2
torchrun=0
if [ "${1:-}" = "--torchrun" ]; then torchrun=1; shift; fi
scripts=("${@:-test_ops.py}")
here=$(cd "$(dirname "$0")/../.." && pwd)
launch=$here/build/bin/accel-launch
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

echo "| launcher | script | runs | failed | Gloo exit abort | other |"
echo "|---|---|---:|---:|---:|---:|"
for s in "${scripts[@]}"; do
  file=$dir/${s%+destroy}
  if [ "$s" != "${s%+destroy}" ]; then
    sed 's/^    test_copy_tensor_to_devices(state)$/&\n    torch.distributed.destroy_process_group()/' "$file" >"$work/destroy.py"
    file=$work/destroy.py
  fi
  launchers=(accel-launch)
  [ "$torchrun" = 1 ] && launchers+=(torchrun)
  for l in "${launchers[@]}"; do
    failed=0 aborts=0
    for _ in $(seq 1 "$runs"); do
      if [ "$l" = accel-launch ]; then
        cmd=("$launch" -n 2 /usr/bin/python3 "$file")
      else
        cmd=(/usr/bin/python3 -m torch.distributed.run --nproc_per_node 2 --redirects 9:0 --tee 9:0
             --monitor_interval 0.1 "$file")
      fi
      # Why cat for torchrun: accel-launch reads its workers' output through pipes; torchrun's
      # workers write to its stdout, made a pipe here so both are measured alike.
      set +e
      if [ "$l" = accel-launch ]; then
        timeout -s KILL 300 "${cmd[@]}" >"$work/out" 2>&1
        rc=$?
      else
        timeout -s KILL 300 "${cmd[@]}" 2>&1 | cat >"$work/out"
        rc=${PIPESTATUS[0]}
      fi
      set -e
      if [ "$rc" -ne 0 ]; then
        failed=$((failed + 1))
        cp "$work/out" "$keep/$l-${s//\//_}-$failed.log"
        grep -q "terminate called without an active exception" "$work/out" && aborts=$((aborts + 1))
      fi
    done
    echo "| $l | $s | $runs | $failed | $aborts | $((failed - aborts)) |"
  done
done
echo "output of the failed runs: $keep"
