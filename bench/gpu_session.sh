#!/usr/bin/env bash
# The whole GPU check as one prepared run on a lent machine (issues 10, 13, 14): the CUDA
# correctness checks, then the prepared benchmark, every result written under $OUT.
#   here:   bash bench/gpu_wheels.sh
#   device: run with carry [".whl"], timeout_s 600, command `bash bench/gpu_session.sh`
# GPU_SCALE_BUDGET_S (default 330) bounds the benchmark's rows; CUDA_CHECK_S (default 180)
# bounds the checks (CUDA_CHECK_ARGS: `--sections quantized,host_executor` runs only those); GPU_SCALE_REPEATS (default 2) runs each row that many times in turn, since one run
# of a row was seen 0.8-1.5x another of the same work on an H200 (2026-12-04); GPU_SCALE_ARGS adds flags
# (`--dry-run` runs that half here on CPU, `--shapes mixtral` one shape); GPU_SCALE_BUDGET_S=0 skips it.
# GPU_PROFILE_S (default 0: skipped) bounds `bench.gpu_profile` (per-token syncs, copies, launches and the
# costliest ops of the DeepSeek-shape rows; GPU_PROFILE_ARGS adds flags). Record the numbers in bench/RESULTS.md (and the table: $OUT/gpu_scale.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# transformers 5.25 fetches kernels from the Hub by default, and raises without the `kernels` package;
# that machine reaches no network: plain transformers is the baseline there
export USE_HUB_KERNELS=0
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
  | tee -a "$OUT/gpu.txt"
timeout "${CUDA_CHECK_S:-180}" python3 -m bench.cuda_check --out "$OUT/cuda_check.json" ${CUDA_CHECK_ARGS:-} \
  > "$OUT/cuda_check.log" 2>&1
echo "cuda_check exit $?"; tail -n 40 "$OUT/cuda_check.log"
if [ "${GPU_SCALE_BUDGET_S:-330}" != 0 ]; then
  timeout $(( ${GPU_SCALE_BUDGET_S:-330} + 60 )) python3 -m bench.gpu_scale --budget-s "${GPU_SCALE_BUDGET_S:-330}" \
    --repeats "${GPU_SCALE_REPEATS:-2}" --out "$OUT/gpu_scale.md" ${GPU_SCALE_ARGS:-} > "$OUT/gpu_scale.jsonl" 2>&1
  echo "gpu_scale exit $?"; cat "$OUT/gpu_scale.md" 2>/dev/null || tail -n 40 "$OUT/gpu_scale.jsonl"
fi
if [ "${GPU_PROFILE_S:-0}" != 0 ]; then
  timeout "$GPU_PROFILE_S" python3 -m bench.gpu_profile --out "$OUT/gpu_profile.md" ${GPU_PROFILE_ARGS:-} \
    > "$OUT/gpu_profile.jsonl" 2>&1
  echo "gpu_profile exit $?"; cat "$OUT/gpu_profile.md" 2>/dev/null || tail -n 40 "$OUT/gpu_profile.jsonl"
fi
