#!/usr/bin/env bash
# The GPU checks of ../shared/GPU_CHECKS.md, in its order, as one bounded run on a machine with a CUDA GPU.
#
# Usage (repository root, on the GPU machine):  bash benchmarks/gpu_checks.sh [MODEL_DIR]
#   MODEL_DIR: a model made by `prime-node model init` (the warm-started tiny model); default: made here.
#   PYTHON (default python3) must hold a CUDA build of torch. Without network, the project's other
#   dependencies come from wheels in ./.whl (cp312 manylinux; docs/engine.md, "GPU checks", says which and how they were fetched).
#   Written to $OUT (default ./gpu-checks-out): gpu_checks.log, proof_margins.txt and reports.tar.gz (the
#   rollout and verify JSON reports of step 2).
#   GPU_CHECKS_STEPS="1 4" runs only those steps (default: all); GPU_CHECKS_BF16_FILES=N adds N CUDA bfloat16
#   files of 32 prompts, checked on CPU, to step 2.
# Each step has its own time limit and the script goes on after a failure, so one run reports them all.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-checks-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_checks.log") 2>&1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
STEPS=" ${GPU_CHECKS_STEPS:-1 2 3 4 5 6} "
step() { echo; echo "=== $(date +%T) $*"; }
want() { [[ $STEPS == *" $1 "* ]]; }

step "setup"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || echo "setup: editable install failed"
"$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
import prime_node.node.cli.main, hivemind  # noqa: F401  the daemon's imports
print("prime_node and hivemind import")
PYEOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
CLI=("$PY" -m prime_node.node.cli.main)
WORK=$(mktemp -d)
mkdir -p "$WORK/reports"
MODEL=${1:-}
if [ -z "$MODEL" ]; then
  MODEL=$WORK/model
  CUDA_VISIBLE_DEVICES= timeout 600 "${CLI[@]}" model init --out "$MODEL" --threads 8 --no-progress
fi
"${CLI[@]}" keygen --out "$WORK/node.key" >/dev/null

if want 1; then
step "1. pytest -m gpu"
timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -rA tests/test_engine.py tests/test_fsdp_torchrun.py \
  2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
fi

if want 2; then
step "2. CUDA rollouts verified on CPU, CPU rollouts verified on CUDA (float32 with TF32 off, bfloat16)"
RUN=(--checkpoint "$MODEL" --samples 4 --max-new-tokens 64 --temperature 1.0)
cross() {  # cross MADE_ON CHECKED_ON DTYPE [BATCH_COUNTER [PROMPTS]]
  local made=$1 checked=$2 dtype=$3 batch=${4:-0} prompts=${5:-8}
  local name=$made-on-$checked-$dtype-b$batch gen=() check_env=(CUDA_VISIBLE_DEVICES=) threads=()
  local file=$WORK/$name.parquet
  if [ "$made" = cuda ]; then gen=(--gpu); else threads=(--threads 8); fi
  [ "$checked" = cuda ] && check_env=(PRIME_NODE_ENGINE__DEVICE=cuda)
  env $([ "$made" = cpu ] && echo CUDA_VISIBLE_DEVICES=) timeout 120 "${CLI[@]}" rollout "${RUN[@]}" \
    --prompts "$prompts" --compute-dtype "$dtype" "${threads[@]}" "${gen[@]}" --key "$WORK/node.key" --step 0 \
    --batch-counter "$batch" --out "$file" --json --data-dir "$WORK/d" > "$WORK/reports/rollout-$name.json"
  env "${check_env[@]}" timeout 120 "${CLI[@]}" verify "$file" "${RUN[@]}" --compute-dtype "$dtype" --threads 8 \
    --json --data-dir "$WORK/d" > "$WORK/reports/verify-$name.json"
  echo "made on $made, checked on $checked, $dtype, batch $batch: exit $?"
  # at once, so that a run cut short by its time limit still reports every file it checked
  "$PY" benchmarks/proof_margins.py "$WORK/reports/verify-$name.json" 2>&1 | tee -a "$OUT/proof_margins.txt"
}
for dtype in float32 bfloat16; do cross cuda cpu $dtype; cross cpu cuda $dtype; done
# GPU_CHECKS_BF16_FILES=N: N more CUDA bfloat16 files of 32 prompts (other batches) for the bf16 margin's spread.
for batch in $(seq 1 "${GPU_CHECKS_BF16_FILES:-0}"); do cross cuda cpu bfloat16 "$batch" 32; done
tar -czf "$OUT/reports.tar.gz" -C "$WORK" reports
fi

if want 3; then
step "3. vLLM"
if "$PY" -c "import vllm" 2>/dev/null; then
  timeout 300 "${CLI[@]}" rollout "${RUN[@]}" --prompts 8 --key "$WORK/node.key" --step 0 --out "$WORK/vllm.parquet" --gpu \
    --compute-dtype bfloat16 --json --data-dir "$WORK/d" && CUDA_VISIBLE_DEVICES= timeout 120 "${CLI[@]}" verify \
    "$WORK/vllm.parquet" "${RUN[@]}" --compute-dtype bfloat16 --threads 8 --json --data-dir "$WORK/d"
else
  echo "vLLM is not installed on this machine: skipped"
fi
fi

if want 4; then
step "4. prime-node start --gpu with a CPU validator: accepted work, node vs bare engine"
timeout 240 "$PY" benchmarks/node.py --model "$MODEL" --gpu --verify --pairs 2 --prompts 16 --samples 4 \
  --new-tokens 64 2>&1 | tail -15
fi

step "5. trainer --fsdp on NCCL, world size 1: in step 1 (tests/test_fsdp_torchrun.py, marked gpu)"

if want 6; then
step "6. verification vs generation on the GPU"
for dtype in bfloat16 float32; do
  timeout 150 "$PY" benchmarks/proofs.py --model "$MODEL" --device cuda --dtype $dtype --prompts 32 --samples 4 \
    --new-tokens 128 --batch 256 --repeats 2 2>&1 | tail -8
done
fi

step "done"
