#!/usr/bin/env bash
# The GPU checks of issues 20 and 21 as ONE prepared call on a lent H200 (see ../shared/gpu/README.md):
#
#   here, once:  ../shared/gpu/wheels.sh && bash scripts/gpu_check.sh --dry-run   # CPU: parses every command
#   device run:  command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 600
#
# Each part has its own time limit, so one hang or OOM leaves the others' results; everything lands in
# $OUT (the device tool brings it back): gpu_trainer.md, gpu_engine.md, the molt train logs and metrics.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/molt-gpu-out}
mkdir -p "$OUT"
if [ "${1:-}" = "--dry-run" ]; then
  PY=.venv/bin/python
  DEV="--runtime.device cpu --model.preset tiny"
  BENCH="--smoke"
  STEPS=1 SHAPE="--rollout.prompts_per_step 2 --rollout.n_samples_per_prompt 2 --rollout.max_tokens 16"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  PY=python3
  DEV="--runtime.device cuda --model.preset qwen3-0.6b"
  BENCH=""
  STEPS=3 SHAPE="--rollout.prompts_per_step 32 --rollout.n_samples_per_prompt 8 --rollout.max_tokens 320"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/nvidia-smi.txt" 2>&1
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled

part() {  # part NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.log, never stop the script
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0))s"
  tail -n 25 "$OUT/$name.log"
}

part gpu_trainer 170 $PY benchmarks/gpu_trainer.py $BENCH --out "$OUT"
part gpu_engine 170 $PY benchmarks/gpu_engine.py $BENCH --out "$OUT"
# the trainer issue's run: 32 prompts x 8 samples, episodes up to 384 tokens, bf16-mixed, random weights
part train_qwen06 150 $PY -m molt.cli.main train $DEV --model.warmstart_steps 0 $SHAPE --rollout.max_len 384 \
  --rollout.filters \
  --train.max_steps $STEPS --train.warmup_steps 0 --train.micro_batch_tokens 16384 --train.activation_checkpointing \
  --eval.every 0 --log.run_dir "$OUT/train_qwen06"
rm -rf "$OUT"/train_qwen06/checkpoints  # GBs of weights: the metrics are what comes back
# the engine issue's run: the tiny preset in bf16 learns like fp32 (the default recipe's eval gain)
if [ "${1:-}" != "--dry-run" ]; then
  part train_tiny_bf16 100 $PY -m molt.cli.main train --runtime.device cuda --model.dtype bfloat16 \
    --model.warmstart_steps 100 --train.max_steps 30 --log.run_dir "$OUT/train_tiny_bf16"
  rm -rf "$OUT"/train_tiny_bf16/checkpoints
fi
echo "results in $OUT"
