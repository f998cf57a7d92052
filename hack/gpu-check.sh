#!/usr/bin/env bash
# The GPU measurements still owed to issues 4 and 8, as one script for a session lent the H200 (15 minutes
# of device time, start-up included). Run it through the device tool from the repository root, with the
# wheels the GPU image lacks in .whl/ (benchmarks/README.md lists them and the `pip download` command),
# e.g. the command `SFTJOB_GPU_CHECK_SECONDS=500 hack/gpu-check.sh` with carry .whl and timeout_s 570.
# Before step 1 it installs the wheels and imports what the runs need (Liger, bitsandbytes, pydantic, the
# project); where one is missing it stops there (exit 3), since every planned run would silently go
# without Liger, or QLoRA be skipped.
# Results go to $OUT (the device tool's folder) or benchmarks/results/gpu-check/; every run writes its rows
# as it ends, and a run stopped by the budget (SIGINT from timeout, or SIGTERM) writes the row it was in
# with what its finished steps measured (status partial; timeout if none ended), so a cut-short session
# keeps what it measured. Each run also stops by itself after run_seconds (partial, once it has a timed
# step), so one slow run cannot starve the rest. In order, the most valuable rows first:
#   1. --plans: the planned configs for 20 steps at global batch 8, accumulation capped at 2 (the
#      micro-batch alone sets the peak): 1.1B full, 7B LoRA, 7B QLoRA under the A40's 46 GiB cap, then
#      the same at the A800's 80 GiB (peak memory against the planner's estimate and the card), then the
#      1.1B seed (the seed guide's fp16 4 x 8, padded) and plain (bf16, packing, fused AdamW) without and
#      with Liger, the planned rows' ratioToSeed (7B rows: ratioToAnchorSeed, the anchors' seed), then
#      L40S (usually the A40 plan: a copied row); one profiler table, of the 1.1B A40 plan's micro-batch.
#      All of the budget but anchor_step seconds (all of it where less than 3 x anchor_step is left);
#   2. 7B LoRA plain+Liger and the planned A40 config at accumulation 4 (the anchor's setting) on the
#      anchors' workload (lengths 32..2,048, LoRA dropout 0): issue 8's like-for-like 7B LoRA row against
#      the anchor's 12,900 tokens/s. Capped at 4, the A40 plan's settings are plain+Liger's: measured once,
#      and the planned row says it is identical (no MFU verdict at a capped accumulation). About a minute,
#      capped at 150 s.
# The device tool returns at most 8 files: the log, .json/.md/.png per step and one archive of the rest
# (the profiler table). GPU, driver, Python and this script's command are in the log and each JSON's meta.
# SFTJOB_GPU_CHECK_DRY=1 runs the same steps on the CPU with the tiny model (to test this script): the
# tiny shape's plans, its rows given a made-up peak (peakSource "dry-run fake") so the verdicts run.
# SFTJOB_GPU_CHECK_SECONDS (default 480) bounds the whole script, pip install and packing included.
set -euo pipefail
# This session's own command, its settings included: every JSON's meta.sessionCommand.
settings=()
for name in $(compgen -e SFTJOB_GPU_CHECK_ || true); do settings+=("$name=${!name}"); done
SFTJOB_GPU_CHECK_COMMAND="${settings[*]:+${settings[*]} }$0${*:+ $*}"
export SFTJOB_GPU_CHECK_COMMAND
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu-check}"
mkdir -p "$out"
budget="${SFTJOB_GPU_CHECK_SECONDS:-480}"
reserve=30     # after a step: timeout's 20 s grace before SIGKILL, then the packing
anchor_step=90 # kept for step 2 (about a minute) should step 1 run long
run_seconds=60 # one run's wall limit (model build included): a 7B QLoRA plan at 80 GiB takes ~50 s
exec > >(tee -a "$out/gpu-check.log") 2>&1
echo "== $SFTJOB_GPU_CHECK_COMMAND"

if [[ "${SFTJOB_GPU_CHECK_DRY:-}" == 1 ]]; then
  python=(.venv/bin/python)
  needs='import peft, pydantic, transformers, sftjob.planner, sftjob_trainer.loop'
  # The GPU run's code paths on the tiny shape: its plans, copies, verdicts (on a made-up peak) and stops.
  compare=(--tiny --fake-peak --only '^tiny/full/(plain\+liger|planned-A40)$')
  plans=(--tiny --plans --fake-peak --profile '^tiny/full/planned-A40$')
  if ! "${python[@]}" -c 'import matplotlib' 2>/dev/null; then
    echo "== no matplotlib here: no PNG in the dry run (the GPU image has it)"
  fi
else
  python=(python3)
  "${python[@]}" -c 'import sys, sysconfig; print("python", sys.version.split()[0], sysconfig.get_platform())'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  if ! compgen -G '.whl/*.whl' >/dev/null; then
    echo "== stopping before step 1: no wheels in .whl/ (carry .whl; benchmarks/README.md lists them)"
    exit 3
  fi
  site=/tmp/sftjob-site
  if ! "${python[@]}" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl; then
    echo "== stopping before step 1: the wheels in .whl/ did not install (above): one version of each,"
    echo "   built for this Python (printed above; benchmarks/README.md has the pip download command)"
    exit 3
  fi
  export PYTHONPATH="$site:$PWD/operator:$PWD/trainer:$PWD/benchmarks"
  # What the runs import: Liger as the trainer applies it, bitsandbytes for QLoRA, pydantic for the planner.
  needs='import bitsandbytes, peft, pydantic, transformers, sftjob.planner, sftjob_trainer.loop
from liger_kernel.transformers import _apply_liger_kernel_to_instance'
  compare=(--only '^7B/lora/(plain\+liger|planned-A40)$')
  plans=(--plans --profile '^1\.1B/full/planned-A40$')
fi
if ! "${python[@]}" -c "$needs"; then
  echo "== stopping before step 1: an import failed (above); carry the wheels benchmarks/README.md lists"
  echo "   in .whl/. Without liger_kernel every planned run would go without the Liger its plan assumed."
  exit 3
fi

export PYTHONUNBUFFERED=1
step() { # step CAP_SECONDS ARGS...: one benchmark run, stopped (SIGINT: it writes its rows) at the cap
  local cap=$1 start=$SECONDS
  shift
  local left=$((budget - SECONDS - reserve))
  if ((cap < left)); then left=$cap; fi
  if ((left < 30)); then echo "== skipped (budget spent): $*"; return 0; fi
  echo "== $* (${left}s)"
  timeout --signal=INT --kill-after=20 "$left" \
    "${python[@]}" benchmarks/trainer_throughput.py "$@" --out "$out" || echo "== exit $?"
  echo "== $((SECONDS - start))s"
}
first=$((budget - SECONDS - reserve))
if ((first >= 3 * anchor_step)); then first=$((first - anchor_step)); fi # else step 1 takes all
step "$first" "${plans[@]}" --run-seconds "$run_seconds"
step 150 "${compare[@]}" --max-accumulation 4 --workload anchors --run-seconds "$run_seconds"

shopt -s nullglob
extras=()
for path in "$out"/*; do
  case "$path" in
    *.log | *.json | *.md | *.png | *.tar.gz) ;;
    *) extras+=("${path##*/}") ;;
  esac
done
if ((${#extras[@]})); then
  tar -czf "$out/profiles.tar.gz" -C "$out" "${extras[@]}" || echo "== tar failed: dropping ${extras[*]}"
  (cd "$out" && rm -f "${extras[@]}")
fi
ls -l "$out"
files=("$out"/*)
if ((${#files[@]} > 8)); then echo "== ${#files[@]} files in $out: the device tool returns only 8"; fi
echo "== done in ${SECONDS}s of ${budget}s"
