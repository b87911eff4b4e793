#!/usr/bin/env bash
# One prepared GPU run, unattended, under 8 minutes: build the CUDA ops, run the GPU tests, measure
# GPT-2 350M (bf16) under zero1/zero2/zero3 and optimizer offload, FusedAdam vs torch fused AdamW.
#
#   bash benchmarks/gpu.sh                 # results in $OUT (or ./gpu_out): summary.json, table.md, *.log
#   PYTHON=/path/to/python bash benchmarks/gpu.sh
#   bash benchmarks/gpu.sh --cpu-smoke     # the same sections on the CPU with a tiny GPT (checks the script)
#
# Environment: a Python with a CUDA build of torch, lightning, and a CUDA toolkit (nvcc) for the
# build; prepared once with
#   pip install torch                       # the CUDA wheel that fits the driver
#   pip install setuptools wheel ninja && pip install --no-build-isolation -e .[test]
# (this script repeats the last, offline: --no-deps --no-build-isolation, so it never replaces torch).
# Every section runs even when an earlier one failed, each under its own timeout; the exit status is
# the number of failed sections.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-./gpu_out}
SMOKE=""
[ "${1:-}" = "--cpu-smoke" ] && SMOKE="--cpu-smoke"
mkdir -p "$OUT"
FAILED=0
START=$(date +%s)

BUDGET=${GPU_SH_BUDGET_S:-460}  # the whole script stays under 8 minutes: later sections get what is left

section() {  # section NAME SECONDS COMMAND...: run with a timeout, log to $OUT/NAME.log, never stop the script
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  local left=$(( START + BUDGET - t0 ))
  if [ "$left" -lt 20 ]; then
    FAILED=$((FAILED + 1))
    printf '%-22s skipped: out of the %ss budget\n' "$name" "$BUDGET" | tee -a "$OUT/sections.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  [ $rc -ne 0 ] && FAILED=$((FAILED + 1))
  [ $rc -eq 124 ] && echo "  (timed out after ${limit}s)" >>"$OUT/$name.log"
  printf '%-22s rc=%-3s %4ss  (%s/%s.log)\n' "$name" "$rc" "$dt" "$OUT" "$name" | tee -a "$OUT/sections.txt"
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  "$PYTHON" -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'lightning', lightning.__version__)"
  command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "nvcc: not found (the CUDA ops will not build)"
  git rev-parse --short HEAD 2>/dev/null
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
: >"$OUT/sections.txt"

if [ -z "$SMOKE" ]; then
  # ~1-3 min: nvcc compiles csrc/cuda/*.cu; MAX_JOBS bounds ninja's parallel compiles.
  section build 240 env MAX_JOBS=${MAX_JOBS:-8} "$PYTHON" -m pip install --no-deps --no-build-isolation -e .
  section ops_available 60 "$PYTHON" -c "import lightning_zero.ops as o; print(o.available()); assert o.available()['fused_adam'] == 'cuda'"
  section tests_gpu 180 "$PYTHON" -m pytest -m gpu tests/gpu -q -p no:cacheprovider
else
  section tests_gpu 150 "$PYTHON" -m pytest -m gpu tests/gpu -q -p no:cacheprovider
fi

section optim 60 "$PYTHON" benchmarks/gpu_bench.py optim --out "$OUT" $SMOKE
# ddp first: the baseline; then zero2 (the MFU target), the rest; offload is the slowest (CPU step).
for config in ddp zero2 zero3 zero2_offload zero2_offload_serial zero1 zero2_fusedadam zero3_offload; do
  section "train_$config" 60 "$PYTHON" benchmarks/gpu_bench.py train "$config" --out "$OUT" $SMOKE
done

"$PYTHON" benchmarks/gpu_bench.py table --out "$OUT" >/dev/null 2>&1
"$PYTHON" - "$OUT" "$FAILED" "$START" <<'EOF'
import json, sys, time
from pathlib import Path
out, failed, start = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
summary = {"machine": (out / "machine.txt").read_text(), "sections": (out / "sections.txt").read_text(),
           "failed_sections": failed, "wall_s": time.time() - start,
           "results": {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem != "summary"}}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
EOF
echo
cat "$OUT/table.md" 2>/dev/null
echo "failed sections: $FAILED; wall $(( $(date +%s) - START ))s; results in $OUT"
exit "$FAILED"
