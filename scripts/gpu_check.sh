#!/usr/bin/env bash
# On a machine with CUDA: run every shipped fixture bundle with --target cuda --reference cpu and
# check each verdict, replay a Megatron-core bundle on the GPU, then run the suite's CUDA tests,
# the Guard's side-stream snapshot check and
# the Guard benchmark on the GPU. Exits non-zero on any
# surprise. Usage: bash scripts/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh     # the Python the README's set-up installed into ($PY)
out=${1:-$(mktemp -d)}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "gpu_check: no CUDA device here" >&2; exit 2; }
"$PY" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name())"
fail=0
# bundle, expected exit code, extra flags
while read -r name want flags; do
  [ -z "$name" ] && continue
  mkdir -p "$out/$name"
  # shellcheck disable=SC2086
  "$PY" -m nanbisect run "fixtures/bundles/$name" --target cuda --reference cpu \
      --out "$out/$name" $flags > "$out/$name.txt" 2>&1
  code=$?
  printf '%-30s exit %s (want %s)  %s\n' "$name" "$code" "$want" "$(head -1 "$out/$name.txt")"
  [ "$code" = "$want" ] || fail=1
done <<'LIST'
forward_nan_behind_mask 1
backward_nan_custom_function 1
optimizer_adam_eps0 1
overflow_then_nan 1
moe_unpermute_fp32_probs 1
fully_masked_row 1
nan_batch 1
healthy 0
deterministic_gpt 0
moe_unpermute_on_npu 1 --inject fixtures/inject/npu_kernels.py:npu
deterministic_gpt 1 --inject fixtures/inject/matmul_off.py:matmul_off
LIST
# Multi-rank: bundles captured on CPU (gloo) here, replayed on the GPU. One rank alone
# (--ranks 1: one process, collectives served as recorded) needs one GPU; the lockstep replay of
# two ranks with a CPU reference (cpu:gloo,cuda:nccl in one process group) needs two.
mr() {  # name, expected exit, bundle, flags...
  local name=$1 want=$2 bundle=$3; shift 3
  "$PY" -m nanbisect run "$bundle" --target cuda --reference cpu --out "$out/$name" "$@" \
      > "$out/$name.txt" 2>&1
  local code=$?
  printf '%-30s exit %s (want %s)  %s\n' "$name" "$code" "$want" "$(head -1 "$out/$name.txt")"
  [ "$code" = "$want" ] || fail=1
}
capture() {  # script, func -> prints the bundle path
  "$PY" -m torch.distributed.run --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d \
      --rdzv-endpoint=127.0.0.1:0 "$1" "$2" "$out/capture-$2" 2>/dev/null \
      | sed -n 's/^BUNDLE //p' | head -1
}
b=$(capture tests/tasks/ddp_train.py rank1_nan)
[ -n "$b" ] && mr mr_rank1_alone_cuda 1 "$b" --ranks 1 || { echo "gpu_check: capture failed"; fail=1; }
grep -q "numerics" "$out/mr_rank1_alone_cuda.txt" || fail=1
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)"; then
  b=$(capture tests/tasks/mr_moe.py moe_ddp)
  mr mr_moe_ddp_cuda 1 "$b" --inject tests/tasks/mr_moe.py:broken_unpermute
  grep -q "classification: device" "$out/mr_moe_ddp_cuda.txt" || fail=1
else
  echo "gpu_check: one GPU: the two-rank lockstep replay on CUDA is not checked"
fi
# Megatron-core: its GPT, tensor parallel 2, captured on CPU ranks; rank 1 replayed alone on the
# GPU with a CPU reference: megatron's own CUDA allocations on the GPU (on_cpu(model) idle there)
# and the shims on the reference's CPU side, in one process
b=$("$PY" -m nanbisect.multirank.spawn --world=2 --group -- examples/megatron_gpt.py tp \
      "$out/capture-megatron" 2>/dev/null | sed -n 's/^RANK [0-9]* BUNDLE //p' | head -1)
if [ -n "$b" ]; then
  mr megatron_tp_rank1_cuda 1 "$b" --ranks 1
  grep -q "aten.sqrt" "$out/megatron_tp_rank1_cuda.txt" || fail=1
else
  echo "gpu_check: the megatron capture failed"; fail=1
fi
"$PY" -m pytest -q tests/reference/test_differential.py -k cuda || fail=1
# Guard on the GPU: the snapshot on a side stream is the pre-step state (bit for bit against a
# synchronous copy), and what the Guard costs with and without it, at batch 2 and 8
"$PY" scripts/check_snapshot_stream.py --device cuda || fail=1
for b in 2 8; do
  "$PY" scripts/bench_guard.py --device cuda --batch $b --steps 30 --json "$out/guard-cuda-b$b.json" \
      > "$out/guard-cuda-b$b.txt" 2>&1 || fail=1
  "$PY" scripts/bench_guard.py --device cuda --batch $b --steps 30 --no-snapshot-stream \
      --json "$out/guard-cuda-b$b-nostream.json" > "$out/guard-cuda-b$b-nostream.txt" 2>&1 || fail=1
  grep -h "^overhead" "$out/guard-cuda-b$b.txt" "$out/guard-cuda-b$b-nostream.txt" | sed "s/^/batch $b: /"
done
exit $fail
