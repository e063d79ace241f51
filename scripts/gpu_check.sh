#!/usr/bin/env bash
# GPU check for a CUDA machine, under 8 minutes, ending with one summary:
#   1. the transformers-parity tests on the GPU (tiny random llama/qwen2/qwen3: logits, greedy
#      generation eager and with CUDA graphs) and compiled-vs-eager greedy tokens for FullKV and
#      BeaconKV (tests/test_compile.py, CUDA tests), plus the CPU parity suite;
#   2. compiled decode with CUDA graphs on the embedded SmolLM2-135M (bf16, batch 8): FullKV and
#      BeaconKV(128), eager vs compiled ms/step and token agreement;
#   3. the Table-4-style run: a Qwen3-4B-shaped random-weight model in bf16, batch 16, caches sized
#      for a 32K-token generation, FullKV vs BeaconKV(2048);
#   4. the engine section of the bench on the same Qwen3-4B shape: continuous batching vs static
#      batches, BeaconKV vs FullKV under one KV-memory limit (32 requests of 64..1024 new tokens).
# Usage: scripts/gpu_check.sh [output dir]   (default: $OUT or results/gpu_check)
# Each stage has its own time limit; a failing stage is reported and the next one still runs.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-results/gpu_check}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"
START=$(date +%s)
declare -a SUMMARY

stage() {  # stage <name> <seconds> <command...>
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$? dt=$(( $(date +%s) - t0 ))
  tail -n 25 "$OUT_DIR/$name.log"
  case $rc in 0) status=ok;; 124|130) status="TIMEOUT";; *) status="FAILED (rc $rc)";; esac
  SUMMARY+=("$name: $status in ${dt}s")
}

"$PY" - <<'PYEOF' > "$OUT_DIR/device.txt" 2>&1
import torch
print(torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
PYEOF
cat "$OUT_DIR/device.txt"

stage parity_and_compile_tests 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_compile.py tests/models/test_parity.py

stage cuda_graph_decode 120 "$PY" - <<'PYEOF'
import time, torch, beaconkv
from beaconkv.policies import BeaconKV
model = beaconkv.load_model(beaconkv.embedded_model_path(), dtype="bf16", device="cuda")
g = torch.Generator().manual_seed(0)
prompts = torch.randint(3, 49152, (8, 64), generator=g).tolist()
for name, make in (("FullKV", lambda: None), ("BeaconKV(128)", lambda: BeaconKV(128))):
    res = {}
    for mode in (False, True, True):  # the second compiled run is warm
        out = beaconkv.generate(model, None, prompts, max_new_tokens=256, eos_token_ids=[], policy=make(), compile=mode)
        s = out.stats
        res[mode] = (out.token_ids, 1e3 * (s.wall_time_s - s.prefill_s) / s.decode_steps, s.compiled_evictions)
    same = sum(a == b for a, b in zip(res[False][0], res[True][0]))
    print(f"{name}: eager {res[False][1]:.2f} ms/step, compiled (CUDA graphs) {res[True][1]:.2f} ms/step "
          f"({res[False][1] / res[True][1]:.1f}x), {same}/8 sequences identical to eager (bf16), "
          f"{res[True][2]} compiled evictions")
PYEOF

stage table4_qwen3_4b_batch16 300 "$PY" -m beaconkv.measure.table4 --model qwen3-4b --dtype bf16 --batch 16 \
  --generation-tokens 32768 --budget 2048 --cycles 1 --device cuda --out "$OUT_DIR/table4"

stage engine_qwen3_4b 300 "$PY" -m beaconkv.measure.speed --sections engine --device cuda --engine-model qwen3-4b \
  --engine-requests 32 --engine-min-new 64 --engine-max-new 1024 --engine-prompt-tokens 256 --engine-budget 256 \
  --engine-full-slots 8 --engine-max-slots 64 --out "$OUT_DIR/engine"

echo
echo "================ GPU check summary ($(cat "$OUT_DIR/device.txt" | head -1)) ================"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
grep -E "passed|failed|error" "$OUT_DIR/parity_and_compile_tests.log" | tail -n 1 | sed 's/^/  tests: /'
grep -E "^(FullKV|BeaconKV)" "$OUT_DIR/cuda_graph_decode.log" | sed 's/^/  decode: /'
[ -f "$OUT_DIR/table4/table4.md" ] && sed 's/^/  /' "$OUT_DIR/table4/table4.md"
[ -f "$OUT_DIR/engine/bench.md" ] && grep -E "^\| (engine|static|target|.*engine section)" "$OUT_DIR/engine/bench.md" | sed 's/^/  /'
echo "  total $(( $(date +%s) - START ))s; logs in $OUT_DIR"
