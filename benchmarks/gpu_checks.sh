#!/usr/bin/env bash
# The GPU checks of ../shared/GPU_CHECKS.md, in its order, as one bounded run on a machine with a CUDA GPU.
#
# Usage (repository root, on the GPU machine):  bash benchmarks/gpu_checks.sh [MODEL_DIR]
#   MODEL_DIR: a model made by `prime-node model init` (the warm-started tiny model); default: made here.
#   PYTHON (default python3) must hold a CUDA build of torch. Without network, the project's other
#   dependencies come from wheels in ./.whl (cp312 manylinux; see docs/gpu.md for how they were fetched).
#   Everything is written to $OUT (default ./gpu-checks-out): gpu_checks.log and one file per step.
# Each step has its own time limit and the script goes on after a failure, so one run reports them all.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-checks-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_checks.log") 2>&1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
step() { echo; echo "=== $(date +%T) $*"; }

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
MODEL=${1:-}
if [ -z "$MODEL" ]; then
  MODEL=$WORK/model
  CUDA_VISIBLE_DEVICES= timeout 600 "${CLI[@]}" model init --out "$MODEL" --threads 8 --no-progress
fi
"${CLI[@]}" keygen --out "$WORK/node.key" >/dev/null

step "1. pytest -m gpu"
timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -rA tests/test_engine.py tests/test_fsdp_torchrun.py \
  2>&1 | tail -25

step "2. CUDA rollouts verified on CPU, CPU rollouts verified on CUDA (float32 with TF32 off, bfloat16)"
RUN=(--checkpoint "$MODEL" --samples 4 --max-new-tokens 64 --temperature 1.0)
cross() {  # cross MAKE_ON CHECK_ON DTYPE
  local made=$1 checked=$2 dtype=$3 file=$WORK/$1-$3.parquet
  local gen=() check_env=(CUDA_VISIBLE_DEVICES=)
  [ "$made" = cuda ] && gen=(--gpu)
  [ "$checked" = cuda ] && check_env=(PRIME_NODE_ENGINE__DEVICE=cuda)
  if [ "$made" = cuda ]; then
    timeout 120 "${CLI[@]}" rollout "${RUN[@]}" --prompts 8 --compute-dtype "$dtype" --key "$WORK/node.key" --step 0 \
      --out "$file" --json "${gen[@]}" --data-dir "$WORK/d" > "$OUT/rollout-$made-$dtype.json"
  else
    CUDA_VISIBLE_DEVICES= timeout 120 "${CLI[@]}" rollout "${RUN[@]}" --prompts 8 --compute-dtype "$dtype" --threads 8 \
      --key "$WORK/node.key" --step 0 --out "$file" --json --data-dir "$WORK/d" > "$OUT/rollout-$made-$dtype.json"
  fi
  env "${check_env[@]}" timeout 120 "${CLI[@]}" verify "$file" "${RUN[@]}" --compute-dtype "$dtype" --threads 8 \
    --json --data-dir "$WORK/d" > "$OUT/verify-$made-on-$checked-$dtype.json"
  echo "made on $made, checked on $checked, $dtype: exit $? $(head -c 300 "$OUT/verify-$made-on-$checked-$dtype.json")"
}
for dtype in float32 bfloat16; do cross cuda cpu $dtype; cross cpu cuda $dtype; done
"$PY" benchmarks/proof_margins.py "$OUT"/verify-*.json 2>&1 | tee "$OUT/proof_margins.txt"

step "3. vLLM"
if "$PY" -c "import vllm" 2>/dev/null; then
  timeout 300 "${CLI[@]}" rollout "${RUN[@]}" --prompts 8 --key "$WORK/node.key" --step 0 --out "$WORK/vllm.parquet" --gpu \
    --compute-dtype bfloat16 --json --data-dir "$WORK/d" && CUDA_VISIBLE_DEVICES= timeout 120 "${CLI[@]}" verify \
    "$WORK/vllm.parquet" "${RUN[@]}" --compute-dtype bfloat16 --threads 8 --json --data-dir "$WORK/d"
else
  echo "vLLM is not installed on this machine: skipped"
fi

step "4. prime-node start --gpu with a CPU validator: accepted work, node vs bare engine"
timeout 240 "$PY" benchmarks/node.py --model "$MODEL" --gpu --verify --pairs 2 --prompts 16 --samples 4 \
  --new-tokens 64 2>&1 | tail -15

step "5. trainer --fsdp on NCCL, world size 1: in step 1 (tests/test_fsdp_torchrun.py, marked gpu)"

step "6. verification vs generation on the GPU"
for dtype in bfloat16 float32; do
  timeout 150 "$PY" benchmarks/proofs.py --model "$MODEL" --device cuda --dtype $dtype --prompts 32 --samples 4 \
    --new-tokens 128 --batch 256 --repeats 2 2>&1 | tail -8
done
step "done"
