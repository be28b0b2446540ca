#!/usr/bin/env bash
# The GPU checks of issues 20 and 21 as ONE prepared call on a lent H200 (see ../shared/gpu/README.md):
#
#   here, once:  ../shared/gpu/wheels.sh && bash scripts/gpu_check.sh --dry-run   # CPU: parses every command
#   device run:  command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 600
#
# Each part has its own time limit, so one hang or OOM leaves the others' results. Logs and reports go to a
# scratch folder that is archived into $OUT/molt-gpu.tgz after every part (the device brings back at most 8
# files, and a run stopped at its limit still returns the parts done); the Markdown tables sit beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/molt-gpu-out}
RAW=$(mktemp -d /tmp/molt-gpu-raw.XXXXXX)  # this call's own scratch folder
mkdir -p "$OUT"
if [ "${1:-}" = "--dry-run" ]; then
  PY=.venv/bin/python
  DEV="--runtime.device cpu --model.preset tiny"
  BENCH="--smoke" TCASES=""
  STEPS=1 SHAPE="--rollout.prompts_per_step 2 --rollout.n_samples_per_prompt 2 --rollout.max_tokens 16"
  TINY="--runtime.device cpu --model.warmstart_steps 2 --train.max_steps 1 --eval.num_prompts 2 --rollout.filters"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  PY=python3
  DEV="--runtime.device cuda --model.preset qwen3-0.6b"
  BENCH="" TCASES="16K rows,32K sample"
  STEPS=3 SHAPE="--rollout.prompts_per_step 32 --rollout.n_samples_per_prompt 8 --rollout.max_tokens 320"
  TINY="--runtime.device cuda --model.warmstart_steps 100 --train.max_steps 30"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$RAW/nvidia-smi.txt" 2>&1
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled
# default: what is still unmeasured, and the engine again after the host-overhead and bf16-numerics changes of
# session 15 (the kernel check passed on the H200 at f7a0e5f). Limits fit one 15-minute lease: ~30 s start + 560 s.
PARTS=${PARTS:-gpu_engine train_tiny_bf16 train_qwen06 gpu_trainer}  # a subset: PARTS="kernel_check" ...

part() {  # part NAME SECONDS CMD...: run with a limit, log to $RAW/NAME.log, archive, never stop the script
  local name=$1 limit=$2
  shift 2
  [[ " $PARTS " == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$RAW/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0))s"
  tail -n 25 "$RAW/$name.log"
  rm -rf "$RAW"/*/checkpoints  # GBs of weights: the logs and metrics are what comes back
  tar czf /tmp/molt-gpu.tgz -C "$RAW" . && mv /tmp/molt-gpu.tgz "$OUT/"
  find "$RAW" -maxdepth 1 -name '*.md' -exec cp {} "$OUT/" \;
}

# the engine's Triton paged-attention kernel in bf16 against the torch reference (the interpreter cannot run bf16)
part kernel_check 25 $PY -c "
import sys, torch; sys.path.insert(0, 'tests/engine')
from test_graphs import dense_reference, paged_case
from molt.engine.paged_attention import triton_paged_decode
dev = 'cuda' if torch.cuda.is_available() else 'cpu'
for dtype, heads, kv in [(torch.bfloat16, 16, 8), (torch.bfloat16, 4, 4), (torch.float32, 16, 8)]:
    q, k, v, table, lens = (x.to(dev) for x in paged_case(dtype, heads, kv, head_dim=128))
    ref = dense_reference(q.float(), k.float(), v.float(), table, lens)
    out = triton_paged_decode(q, k, v, table, lens, 128 ** -0.5) if dev == 'cuda' else ref
    print(dtype, heads, kv, 'max |diff|', (out.float() - ref).abs().max().item())
"
part gpu_engine 130 $PY benchmarks/gpu_engine.py $BENCH --out "$RAW"
# the first compile of each compiled system took > 100 s on the H200's host: last, with what time is left
part gpu_trainer 190 $PY benchmarks/gpu_trainer.py $BENCH --cases "$TCASES" --budget-s 175 --out "$RAW"
# the trainer issue's run: 32 prompts x 8 samples, episodes up to 384 tokens, bf16-mixed, random weights
part train_qwen06 150 $PY -m molt.cli.main train $DEV --model.warmstart_steps 0 $SHAPE --rollout.max_len 384 \
  --rollout.filters \
  --train.max_steps $STEPS --train.warmup_steps 0 --train.micro_batch_tokens 16384 --train.activation_checkpointing \
  --train.compile off \
  --eval.every 0 --log.run_dir "$RAW/train_qwen06"
# the engine issue's run: the tiny preset in bf16 learns like fp32 (the default recipe's eval gain)
part train_tiny_bf16 90 $PY -m molt.cli.main train $TINY --model.dtype bfloat16 --log.run_dir "$RAW/train_tiny_bf16"
echo "results in $OUT: $(ls "$OUT")"
rm -rf "$RAW"
