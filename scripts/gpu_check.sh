#!/usr/bin/env bash
# GPU check for a CUDA machine, each stage under its own time limit (17 min at most in all; `--only` reruns stages), ending with one summary:
#   1. the CUDA tests (tests marked `cuda`: transformers parity of tiny random llama/qwen2/qwen3, eager
#      and with CUDA graphs; CUDA graphs vs eager greedy tokens and kept positions; decode and eviction
#      of every policy with torch.cuda.set_sync_debug_mode("error"));
#   2. compiled decode with CUDA graphs on the embedded SmolLM2-135M (bf16, batch 8): FullKV and
#      BeaconKV(128), eager vs compiled ms/step, first compile seconds and token agreement, the step
#      compiled by regions (one layer compiled, one graph replayed), then whole (every layer traced:
#      it may outlast the stage's limit; the regions lines are printed first);
#   3. the Table-4-style run: a Qwen3-4B-shaped random-weight model in bf16, batch 16, caches sized
#      for a 32K-token generation, FullKV vs BeaconKV(2048);
#   4. the engine section of the bench on the same Qwen3-4B shape: continuous batching vs static
#      batches, BeaconKV vs FullKV under one KV-memory limit (32 requests of 64..1024 new tokens).
#
# Usage: scripts/gpu_check.sh [--device cuda|cpu] [--smoke] [--only STAGES] [--decode-model M] [output dir]
#   (default dir: $OUT or results/gpu_check)
#   --smoke       every stage at tiny shapes (a tiny random Qwen3-shaped model, a few hundred tokens,
#                 aot_eager graphs, a few CUDA tests): proves that each stage's modules, flags and
#                 functions exist; `make test` runs `--device cpu --smoke` (tests/test_gpu_check.py).
#   --device cpu  run the stages on the CPU (only meaningful with --smoke).
#   --only STAGES comma-separated stage names to run (default: all four), e.g. to rerun the ones that failed:
#                 parity_and_compile_tests, cuda_graph_decode, table4_qwen3_4b_batch16, engine_qwen3_4b.
#   --decode-model M  the model of stage 2 (default: embedded; smollm2-135m is its shape with random weights,
#                 for a machine where the embedded model's package cannot be installed).
# Each stage has its own time limit; a failing stage is reported and the next one still runs. The exit
# status is 0 only if every stage passed.
set -u
cd "$(dirname "$0")/.."
DEVICE=cuda
SMOKE=0
OUT_DIR="${OUT:-results/gpu_check}"
ONLY=""
DECODE_MODEL=""
STAGES="parity_and_compile_tests cuda_graph_decode table4_qwen3_4b_batch16 engine_qwen3_4b"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2;;
    --device=*) DEVICE="${1#*=}"; shift;;
    --smoke) SMOKE=1; shift;;
    --only) ONLY="$2"; shift 2;;
    --only=*) ONLY="${1#*=}"; shift;;
    --decode-model) DECODE_MODEL="$2"; shift 2;;
    --decode-model=*) DECODE_MODEL="${1#*=}"; shift;;
    -h|--help) sed -n '2,20p' "$0"; exit 0;;
    -*) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2;;
    *) OUT_DIR="$1"; shift;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check.sh: --device $DEVICE: choose cuda or cpu" >&2; exit 2;; esac
for name in ${ONLY//,/ }; do
  case " $STAGES " in *" $name "*) ;; *) echo "gpu_check.sh: --only $name: no such stage (stages: $STAGES)" >&2; exit 2;; esac
done
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"
START=$(date +%s)
FAILED=0
declare -a SUMMARY

stage() {  # stage <name> <seconds> <command...>
  local name=$1 limit=$2; shift 2
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$? dt=$(( $(date +%s) - t0 ))
  tail -n 25 "$OUT_DIR/$name.log"
  case $rc in 0) status=ok;; 124|130) status="TIMEOUT"; FAILED=1;; *) status="FAILED (rc $rc)"; FAILED=1;; esac
  SUMMARY+=("$name: $status in ${dt}s")
}

"$PY" - "$DEVICE" <<'PYEOF' > "$OUT_DIR/device.txt" 2>&1
import sys, torch
want = sys.argv[1]
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA"
print(torch.__version__, "cuda", torch.version.cuda, name if want == "cuda" else f"CPU run ({name} here)")
PYEOF
cat "$OUT_DIR/device.txt"

if [ "$SMOKE" = 1 ]; then
  # tiny shapes: a 2-layer random Qwen3 shape, a few hundred tokens, graphs traced with aot_eager
  TESTS=(-m cuda -k "never_wait and beacon-eager" tests/execution/test_sync.py)  # the rest runs in make test itself
  DECODE=(--model qwen3-tiny --dtype fp32 --batch 2 --prompt-tokens 16 --new-tokens 48 --budget 32 --n-recent 4 --compile-backend aot_eager)
  TABLE4=(--model qwen3-tiny --dtype fp32 --batch 2 --generation-tokens 320 --budget 128 --cycles 1 --mode eager --in-process)
  ENGINE=(--engine-model qwen3-tiny --engine-dtype fp32 --engine-requests 6 --engine-min-new 8 --engine-max-new 48
          --engine-prompt-tokens 128 --engine-budget 32 --engine-full-slots 2 --engine-max-slots 6 --no-transformers
          --compile-backend aot_eager)
  LIMITS=(240 120 120 240)
else
  TESTS=(-n 8 -m cuda tests/test_compile.py tests/execution/test_sync.py)  # 8 pytest-xdist workers share the GPU
  DECODE=(--model embedded --dtype bf16 --batch 8 --prompt-tokens 64 --new-tokens 256 --budget 128)
  TABLE4=(--model qwen3-4b --dtype bf16 --batch 16 --generation-tokens 32768 --budget 2048 --cycles 1)
  ENGINE=(--engine-model qwen3-4b --engine-requests 32 --engine-min-new 64 --engine-max-new 1024
          --engine-prompt-tokens 256 --engine-budget 256 --engine-full-slots 8 --engine-max-slots 64)
  LIMITS=(200 240 300 300)
fi
[ -n "$DECODE_MODEL" ] && DECODE=(--model "$DECODE_MODEL" "${DECODE[@]:2}")

stage parity_and_compile_tests "${LIMITS[0]}" "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
stage cuda_graph_decode "${LIMITS[1]}" "$PY" -m beaconkv.measure.speed.graph_decode --device "$DEVICE" "${DECODE[@]}"
stage table4_qwen3_4b_batch16 "${LIMITS[2]}" "$PY" -m beaconkv.measure.speed.table4 --device "$DEVICE" "${TABLE4[@]}" \
  --out "$OUT_DIR/table4"
stage engine_qwen3_4b "${LIMITS[3]}" "$PY" -m beaconkv.measure.speed --sections engine --device "$DEVICE" "${ENGINE[@]}" \
  --out "$OUT_DIR/engine"

echo
echo "================ GPU check summary ($(head -1 "$OUT_DIR/device.txt")$([ "$SMOKE" = 1 ] && echo ", smoke")) ================"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
grep -E "passed|failed|error" "$OUT_DIR/parity_and_compile_tests.log" 2>/dev/null | tail -n 1 | sed 's/^/  tests: /'
grep -E "^(FullKV|BeaconKV)" "$OUT_DIR/cuda_graph_decode.log" 2>/dev/null | sed 's/^/  decode: /'
[ -f "$OUT_DIR/table4/table4.md" ] && sed 's/^/  /' "$OUT_DIR/table4/table4.md"
[ -f "$OUT_DIR/engine/bench.md" ] && grep -E "^\| (engine|static|target|.*engine section)" "$OUT_DIR/engine/bench.md" | sed 's/^/  /'
echo "  total $(( $(date +%s) - START ))s; logs in $OUT_DIR"
exit $FAILED
