#!/usr/bin/env bash
# The GPU check, sized to one device call: figures first, every stage under one deadline (default 450 s).
#   1. table4            the paper's Table 4 on the Qwen3-4B shape (random weights, bf16): FullKV vs BeaconKV(2048)
#                        at batch 14 — peak memory (torch.cuda.max_memory_allocated) beside `beaconkv memory`'s
#                        prediction, tokens/s of a 32K-token generation integrated from cache fill levels — then
#                        each at the largest batch that fits 90% of the device;
#   2. engine            the engine section at one KV-memory limit (continuous vs static batches, BeaconKV vs FullKV);
#   3. cuda_tests        the tests marked `cuda` (8 workers with pytest-xdist);
#   4. tensor_parallel   python -m beaconkv.measure.distributed_check: NCCL over 2 GPUs (gloo with --device cpu), tokens and
#                        kept positions equal to one process; with fewer than 2 GPUs it says it skipped TP;
#   5. graph_vs_compile  recorded CUDA graphs vs inductor's shapes (SmolLM2-135M shape): runs when time is left.
# Each stage prints its lines as they come and writes JSON under the output folder; a stage (or, inside table4, a
# measurement) that would not fit the time left prints "skipped: would need ~N s, M s left".
#
# Usage: scripts/gpu_check.sh [--device cuda|cpu] [--smoke] [--deadline-s S] [--only STAGES] [output dir]
#   (output: the argument, else $OUT, else results/gpu_check)
#   --smoke        every stage at tiny shapes; `make test` runs `--device cpu --smoke` (tests/test_gpu_check.py)
#   --device cpu   the CPU rehearsal (with --smoke): the recorded graphs through the op-replay recorder
#   --only STAGES  comma-separated, e.g. --only table4
#
# It runs on the machine's own python (python3, or $PYTHON) and packages with this folder on PYTHONPATH and
# installs nothing: when a package beaconkv needs is missing it refuses in one line naming them (exit 3); a stage
# whose own packages are missing (pytest for the tests) is skipped with their names. Models are random-weight
# shapes built on the device: nothing large travels. Exit status: 0 when no stage failed, 1 otherwise.
set -u
STARTED=$(date +%s.%N)
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
case " $* " in *" -h "*|*" --help "*) sed -n '2,24p' "$0"; exit 0;; esac
if ! command -v "$PY" > /dev/null 2>&1; then
  echo "gpu_check.sh: refused: no python ($PY) on this machine; set PYTHON=/path/to/python" >&2
  exit 3
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# What is missing, found without installing anything: import the check's own module; each missing package is noted
# and stood in for by an empty module so that the next one shows, and the one line names them all.
"$PY" - <<'PYEOF' || exit 3
import importlib, sys, types

if sys.version_info < (3, 10):
    print(f"gpu_check.sh: refused: python {sys.version.split()[0]} is older than 3.10, which beaconkv needs",
          file=sys.stderr)
    sys.exit(3)


class _Anything(types.ModuleType):
    __path__ = []  # a package: its submodules import too

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None,
                               "__call__": lambda self, *a, **k: a[0] if a else None,
                               "__class_getitem__": classmethod(lambda cls, item: cls)})


missing = []
for _ in range(30):
    try:
        importlib.import_module("beaconkv.measure.speed.gpu_check")
        importlib.import_module("beaconkv.measure.speed.table4_generation")
        importlib.import_module("beaconkv.measure.speed.engine_bench")
        importlib.import_module("beaconkv.measure.speed.graph_decode")
        importlib.import_module("beaconkv.measure.distributed_check")
        break
    except ModuleNotFoundError as err:
        name = (err.name or "").split(".")[0]
        if not name or name == "beaconkv" or name in missing:
            print(f"gpu_check.sh: refused: beaconkv does not import here: {err}", file=sys.stderr)
            sys.exit(3)
        missing.append(name)
        for module in [m for m in sys.modules if m == "beaconkv" or m.startswith("beaconkv.")]:
            del sys.modules[module]
        sys.modules[name] = _Anything(name)
    except Exception as err:  # a stand-in met something it cannot stand for: name what is known
        if missing:
            break
        print(f"gpu_check.sh: refused: beaconkv does not import here: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(3)
if missing:
    print(f"gpu_check.sh: refused: {sys.executable} lacks {', '.join(missing)} (needed by beaconkv); this check "
          "installs nothing: run it where they are installed", file=sys.stderr)
    sys.exit(3)
PYEOF
exec "$PY" -m beaconkv.measure.speed.gpu_check --started-at "$STARTED" "$@"
