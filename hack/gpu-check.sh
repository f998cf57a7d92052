#!/usr/bin/env bash
# The GPU measurements still owed to issues 4 and 8, as one script for a session lent the H200 (15 minutes
# of device time, start-up included). Run it through the device tool from the repository root, with the
# wheels the GPU image lacks in .whl/ (liger-kernel, bitsandbytes, pydantic and its deps; see
# benchmarks/README.md), e.g. `run --carry .whl --timeout_s 560 -- hack/gpu-check.sh`. Results go to $OUT
# (the device tool's folder) or benchmarks/results/gpu-check/; every run writes its rows as it ends, so a
# cut-short session keeps what finished. In priority order:
#   1. --plans --profile: the planned configs (1.1B full, 7B LoRA, 7B QLoRA; A800 at 80 GiB, A40/L40S under a
#      46 GiB cap) for 20 steps, peak memory against the planner's estimate, one profiler table per run;
#   2. 7B LoRA plain+Liger against the planned A40 config, both at accumulation 4 (the anchor's setting).
# SFTJOB_GPU_CHECK_DRY=1 runs the same steps on the CPU with the tiny model (to test this script).
# SFTJOB_GPU_CHECK_SECONDS (default 480) bounds the whole script, so it ends inside the device call and
# still packs the profiler tables into one archive (the device tool returns at most 8 files).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu-check}"
mkdir -p "$out"
budget="${SFTJOB_GPU_CHECK_SECONDS:-480}"
exec > >(tee -a "$out/gpu-check.log") 2>&1

if [[ "${SFTJOB_GPU_CHECK_DRY:-}" == 1 ]]; then
  python=(.venv/bin/python)
  plans=(--tiny --only planned)
  compare=(--tiny --only '^tiny/full/(plain\+liger|planned-A40)$')
else
  python=(python3)
  site=/tmp/sftjob-site
  "${python[@]}" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PWD/operator:$PWD/trainer:$PWD/benchmarks"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia-smi.csv"
  plans=(--plans)
  compare=(--only '^7B/lora/(plain\+liger|planned-A40)$')
fi

export PYTHONUNBUFFERED=1
step() {
  local left=$((budget - SECONDS)) start=$SECONDS
  if ((left < 30)); then echo "== skipped (budget spent): $*"; return 0; fi
  echo "== $* (${left}s left)"
  timeout --signal=INT --kill-after=20 "$left" \
    "${python[@]}" benchmarks/trainer_throughput.py "$@" --out "$out" || echo "== exit $?"
  echo "== $((SECONDS - start))s"
}
step "${plans[@]}" --profile
step "${compare[@]}" --max-accumulation 4
shopt -s nullglob
profiles=("$out"/*-profile-*.txt)
if ((${#profiles[@]})); then
  tar -czf "$out/profiles.tar.gz" -C "$out" "${profiles[@]##*/}" && rm -f "${profiles[@]}"
fi
ls -l "$out"
