#!/usr/bin/env bash
# On a GPU machine set up as docs/install.md "GPU machine without network" says, after .gpu/remote/unpack.sh has
# unpacked both bundle parts: the gpu-marked tests, the torch backend's tests on CUDA, and
# GRPO step time on a random Qwen2.5-0.5B-shape model (gin/experiments/gpu_grpo_0p5b.gin).
# Writes logs and metrics under $OUT. Usage: bash experiments/bench/gpu_run.sh [object_store|cuda_ipc] [tests]
set -u
transport=${1:-object_store}
tests=${2:-tests}
source .gpu/remote/env.sh
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # pure-Python packages the GPU image lacks (array-api-compat)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# polyrl without installing it: its installed layout, as links inside this disposable copy.
ln -sfn ../backends polyrl/backends; ln -sfn ../algos polyrl/algos
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
if [ "$tests" = tests ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/rollout/test_gpu_transports.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" >> "$OUT/summary.txt"
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/backends/torch_fsdp > "$OUT/torch_fsdp_tests.log" 2>&1
  echo "torch_fsdp tests rc=$?" >> "$OUT/summary.txt"
fi
M=/tmp/models/qwen2-0.5b-random
[ -d $M ] || python3 .gpu/remote/make_models.py /tmp/models 0.5b > "$OUT/make_models.log" 2>&1
python3 - <<'PY'  # the copy task's chat template on the bundle's byte-level tokenizer
from transformers import AutoTokenizer
from polyrl.data.tiny import CHAT_TEMPLATE
t = AutoTokenizer.from_pretrained("/tmp/models/qwen2-0.5b-random"); t.chat_template = CHAT_TEMPLATE
t.save_pretrained("/tmp/models/qwen2-0.5b-random")
PY
run=runs/gpu_grpo_$transport
timeout 420 python3 -m polyrl.cli train --gin_file gin/experiments/gpu_grpo_0p5b.gin \
  --gin_param "polyrl.RunConfig.model_path = '$M'" \
  --gin_param "polyrl.RunConfig.run_dir = '$run'" \
  --gin_param "polyrl.RunConfig.weight_transport = '$transport'" > "$OUT/train_$transport.log" 2>&1
echo "train $transport rc=$?" >> "$OUT/summary.txt"
cp "$run/metrics.jsonl" "$OUT/metrics_$transport.jsonl" 2>/dev/null
grep -E "^\[|phase|overhead|done|Error" "$OUT/train_$transport.log" | tail -40 >> "$OUT/summary.txt"
