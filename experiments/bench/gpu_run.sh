#!/usr/bin/env bash
# On the lent GPU machine, in the repo root: every GPU benchmark, each writing a table
# to stdout and JSON (+ logs) under $OUT. docs/performance.md says what each measures.
#
#   bash experiments/bench/gpu_run.sh                      # the one-GPU sections (~20 min)
#   bash experiments/bench/gpu_run.sh train_step rollout   # some of them
#
# Sections (each under ~4 minutes on one H200):
#   tests       the gpu-marked tests, one pytest per file (GPU_TEST_TIMEOUT s each, default
#               300; some need 2 GPUs), and the torch backend's tests on CUDA
#   train_step  1.5B shape, 8 x 2048 tokens, bf16, checkpointing: torch_fsdp (eager and
#               +compile), jax_pjit (its default allocator, cuda_async) and the
#               hand-written HF loop (the limit)
#   update_shape train_step.py on the GRPO experiment's update: 0.5B shape, 64 x (128 + 512)
#               tokens, micro-batches of UPDATE_MB rows (default 64, the experiment's;
#               torch_fsdp eager and +compile, jax_pjit, the hand loop; not in the default list)
#   grpo_torch  gin/experiments/gpu_grpo_0p5b.gin on the torch backend: phase breakdown
#   grpo_jax    the same on the JAX backend, at the experiment's defaults
#   grpo_split  the torch GRPO step on 2 GPUs: actor + rollout on one, the reference on the
#               other (its forward overlaps old log-probs; needs 2 GPUs, not in the default list)
#   rollout     RolloutPool vs vLLM directly, the GRPO rollout shape (0.5B, 64 x 8 x 512)
#   weight_sync sync of the 1.5B shape (bf16, 3.1 GB) per transport, source backend and load path
#               (load plan / load_weights) vs a device copy (weight_sync.py)
#   async       async vs sync GRPO step (async_step.py; needs 2 GPUs, not in the default list)
#   attention   train_step.py on the 1.5B shape, 8 x 2048 full-length tokens, per attention
#               kernel and packing (docs/performance.md "Attention kernels and packing")
#   ragged      the same with ragged lengths (prompts 512-1024, responses 128-1024 tokens),
#               where packing removes padding
#   attention_tests  the attention kernels' gpu tests alone, one line per test (~2 minutes)
#   sync_tests  the weight transports' gpu tests alone (CUDA IPC, load plan vs load_weights,
#               NCCL where 2-3 GPUs), one line per test (~3 minutes; not in the default list;
#               SYNC_TESTS = a pytest -k expression)
#   compile_tests tests/backends/torch_fsdp/test_compile.py on CUDA (torch.compile with Triton;
#               not in the default list)
#   scale_tests 2 GPUs: tests/trainer/test_gpu_sync.py's tensor-parallel rollout server and
#               CUDA IPC from every rank, per backend (~6 minutes; not in the default list;
#               SCALE_TESTS = another pytest -k expression)
#   first_torch / first_jax  time to the first step of the GRPO experiment (first_step.py):
#               cold (empty RunConfig.cache_dir) then warm (not in the default list; ~5 min each)
#   async_engine  vllm.LLM.generate vs AsyncLLM alone (3 interleaved processes each), then
#               polyrl's RolloutServer on each engine: single-turn tokens/s and 4-turn
#               episodes/s (async_engine.py; 0.5B, 64 x 8 x 512; ~9 minutes, not in the
#               default list; AE_MODEL: another model directory, e.g. a 1.5B shape)
#   gsm8k_tool  gin/experiments/gsm8k_tool.gin (multi-turn, Python tool) against the single-turn
#               GSM8K GRPO step: step time and rollout tokens/s side by side (gsm8k_tool.py;
#               random 0.5B shape; not in the default list). GSM8K_ONLY picks the runs
#               (default all four: single,single_async,tool,tool_nosandbox); each takes
#               ~2-2.5 minutes (start-up ~75 s + 3 steps), so the four need two device calls
#               of <= 600 s: GSM8K_ONLY=single_async,tool (the issue-46 ratio) then
#               GSM8K_ONLY=tool_nosandbox,single; gsm8k_tool.py --table puts both JSONs in
#               one table
#   distill     gin/experiments/gpu_distill_0p5b.gin: the GRPO experiment on-policy distilled from
#               a random 1.5B-shape teacher (its phase teacher_log_probs); pair it with grpo_torch
#               (not in the default list; DISTILL_BACKEND, default torch_fsdp)
#   tinker      the Tinker service on the 0.5B shape, one GPU (tinker_overhead.py): a LoRA step
#               of 64 x 640 tokens and 64 x 8 x 512 sampled tokens through the client against the
#               engine and the pool (not in the default list; TINKER_BACKEND, TINKER_STEPS)
#   rollout_7b  the rollout bench on a random Qwen2.5-7B-shape model (random_model.py),
#               64 prompts x 8 x 512 tokens, 0.85 of the GPU (not in the default list)
#   gsm8k_tool_7b gin/experiments/gsm8k_tool_7b_lora.gin alone: GSM8K + Python-tool episodes of up
#               to 8192 tokens on a random Qwen2.5-7B shape with LoRA, every role on one 80 GB
#               GPU (gsm8k_tool.py --only tool): step time, phases, the update's MFU, peak GPU
#               memory (GRPO_STEPS, default 3; not in the default list; ~9 minutes with the
#               model's build: the whole section is bounded by SECTION_TIMEOUT, default 540)
#   shadow      the three-way log-prob check's cost per step on the GRPO experiment
#               (shadow_cost.py; SHADOW_STEPS, default 12, SHADOW_EVERY, default 5; not in the
#               default list; on a fresh machine the run starts in ~135 s and its first step
#               takes ~90 s: 8 steps did not finish in 330 s, give it SECTION_TIMEOUT=540)
#   lora_sync   a LoRA actor's weights to vLLM, merged vs vLLM adapters, 1.5B shape (lora_sync.py;
#               not in the default list; two cold vLLM starts: over 200 s, give it 420)
#   lora_7b     train_step.py on the Qwen2.5-7B shape with LoRA, one GPU, per backend (SUITE;
#               not in the default list)
#   (attention, ragged and attention_tests are not in the default list: ~7 minutes each)
# Env: TRANSPORT (GRPO weight transport, default cuda_ipc), OUT (default /tmp/out),
#   GRPO_STEPS (timed steps per GRPO run, default 4; the first is left out of the means, and
#   one more runs under the profiler),
#   GRPO_TIMEOUT (seconds the GRPO and distill runs may take, default GRPO_STEPS x 60 + 220;
#   keep it ~60 s under the machine's limit for the command: a run stopped at it writes its
#   threads' stacks at the end of $OUT/<section>.log, the steps it finished are measured and
#   the logs are packed; a run the machine's limit stops packs nothing),
#   GIN_EXTRA (more --gin_param bindings for the GRPO and gsm8k_tool runs, separated by ';', e.g.
#   "polyrl.RunConfig.attn_implementation = 'auto'; actor/polyrl.ParallelConfig.micro_batch_size = 16"),
#   UPDATE_MB (the update_shape section's micro-batch rows, default 64), ASYNC_STEPS (default 6), SUITE (the
#   train_step / update_shape sections' --suite), SECTION_TIMEOUT (their bound in s, default
#   420: the +compile entries compile first), SYNC_BUCKET_MB (the weight_sync section's
#   bucket size, default 1024: 3 buckets for the 3.1 GB), SYNC_TRANSPORTS (its
#   --transports, default object_store,cuda_ipc), CKPT (0: the train_step and
#   update_shape sections run without activation checkpointing; default 1), CKPT_POLICY (their
#   --ckpt-policy: full, the default, selective, or budget), MEMORY_BUDGET (their
#   --memory-budget with CKPT_POLICY=budget, default 0.6; a suite entry's +budget=F sets
#   both for that run), ROLLOUT_ARGS (more rollout.py flags, e.g.
#   "--in-process-engine 0").
# The GRPO sections also print the peak GPU memory that nvidia-smi saw on their GPUs (every
# process: the trainer's engines and vLLM alike), sampled every 0.5 s.
# Every section also writes a profiler trace of one step (or the run's phase timeline)
# under $OUT/prof/<section> and prints its top ops (experiments/bench/profiling.py).
# Needs the offline bundle unpacked (.gpu/remote/unpack.sh; docs/install.md, "GPU machine without network").
set -u
sections=${*:-tests train_step grpo_torch grpo_jax rollout weight_sync}
ckpt="--grad-ckpt --ckpt-policy ${CKPT_POLICY:-full}"; [ "${CKPT:-1}" = 0 ] && ckpt=
transport=${TRANSPORT:-cuda_ipc}
source .gpu/remote/env.sh
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # pure-Python packages the GPU image lacks (array-api-compat)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if ! python3 -c "import array_api_compat" 2>/dev/null; then  # scipy vendors a copy
  vendored=$(python3 -c "import scipy, os; print(os.path.dirname(scipy.__file__))")/_external/array_api_compat
  mkdir -p /tmp/shim && ln -sfn "$vendored" /tmp/shim/array_api_compat
  export PYTHONPATH=/tmp/shim:$PYTHONPATH
fi
# polyrl without installing it: its installed layout, as links inside this disposable copy.
ln -sfn ../backends polyrl/backends; ln -sfn ../algos polyrl/algos
export PYTHONPATH=$PWD:$PYTHONPATH POLYRL_BENCH_DIR=/tmp/bench
mkdir -p $POLYRL_BENCH_DIR
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
lscpu | grep -E "^(Model name|Thread|Core|Socket|NUMA|CPU\(s\))" >> "$OUT/gpu.txt"  # the host the engines share
python3 - >> "$OUT/gpu.txt" 2>&1 <<'PY'  # the versions the attention kernels depend on
import jax, torch, transformers
from jax._src.lib import cuda_versions
print("torch", torch.__version__, "jax", jax.__version__, "transformers", transformers.__version__,
      "cudnn(jax)", cuda_versions.cudnn_get_version() if cuda_versions else None)
PY
M=/tmp/models/qwen2-0.5b-random
model() {
  [ -d $M ] || python3 .gpu/remote/make_models.py /tmp/models 0.5b > "$OUT/make_models.log" 2>&1
  python3 - <<'PY'  # the copy task's chat template on the bundle's byte-level tokenizer
from transformers import AutoTokenizer
from polyrl.data.tiny import CHAT_TEMPLATE
t = AutoTokenizer.from_pretrained("/tmp/models/qwen2-0.5b-random"); t.chat_template = CHAT_TEMPLATE
t.save_pretrained("/tmp/models/qwen2-0.5b-random")
PY
}
# peak_mem NAME CMD...: run CMD while nvidia-smi samples the used memory of the GPUs this
# shell sees (CUDA_VISIBLE_DEVICES, default all); the largest sum over them -> $OUT/NAME.mem.txt
peak_mem() {
  local name=$1; shift
  local ids=${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)}
  nvidia-smi -i "$ids" --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/$name.mem.csv" 2>/dev/null &
  local smi=$!
  "$@"; local rc=$?
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  python3 - "$OUT/$name.mem.csv" "$ids" > "$OUT/$name.mem.txt" <<'PY'
import collections, sys
used = collections.Counter()  # timestamp -> MiB summed over the GPUs sampled then
for line in open(sys.argv[1]):
    t, mib = line.rsplit(",", 1)
    used[t.strip()] += int(mib)
print(f"peak GPU memory used (nvidia-smi, GPUs {sys.argv[2]}, all processes): "
      f"{max(used.values(), default=0) / 1024:.1f} GiB")
PY
  return $rc
}
# pack_logs NAME: what a section wrote besides summary.txt and its bench_*.json into
# $OUT/NAME.prof.tgz (profiler traces, under prof/) and $OUT/NAME.logs.tgz (logs, memory
# samples): a copy back that takes few files gets every section whole, the logs come back
# even when the traces are over the copy's size limit, and a section cut off by a time-out
# leaves the earlier ones packed.
pack_logs() {
  local files
  for kind in prof logs; do
    files=$(cd "$OUT" && find . -type f ! -name summary.txt ! -name gpu.txt ! -name 'bench_*.json' \
      ! -name '*.tgz' | { if [ $kind = prof ]; then grep '^./prof/'; else cat; fi; } | sort)
    [ -n "$files" ] || continue
    (cd "$OUT" && tar czf "$1.$kind.tgz" $files && rm -f $files)
  done
  (cd "$OUT" && find . -mindepth 1 -type d -empty -delete)
}
for s in $sections; do
  echo "=== $s" | tee -a "$OUT/summary.txt"; start=$SECONDS
  case $s in
  tests)
    # one pytest per file, each with its own bound and log: a file that hangs or runs long
    # leaves the others' results. The JAX backend's in-process GPU tests get JAX_PLATFORMS
    # (the session pins JAX to the CPU only when it is unset); elsewhere a driver's JAX must
    # stay off the GPU, which its Ray workers and vLLM use.
    for f in $(grep -rlE "pytest\.mark\.gpu|mark\.gpu" tests | sort); do
      log="$OUT/gpu_$(basename "$f" .py).log"
      jp=cpu; case $f in */jax_pjit/*) jp=cuda,cpu ;; esac
      JAX_PLATFORMS=$jp timeout ${GPU_TEST_TIMEOUT:-300} python3 -m pytest -q -rA -p no:cacheprovider -m gpu "$f" > "$log" 2>&1
      echo "$f rc=$? $(tail -1 "$log")" | tee -a "$OUT/summary.txt"
    done
    # test_compile.py compiles with Triton on CUDA: over 150 s alone on an H200
    timeout 480 python3 -m pytest -q -x -p no:cacheprovider tests/backends/torch_fsdp > "$OUT/torch_fsdp_tests.log" 2>&1
    echo "torch_fsdp tests rc=$?" | tee -a "$OUT/summary.txt" ;;
  train_step)
    timeout ${SECTION_TIMEOUT:-420} python3 experiments/bench/train_step.py --suite ${SUITE:-torch_fsdp,torch_fsdp+compile,jax_pjit,hf_torch} \
      --hidden 1536 --layers 28 --heads 12 --kv-heads 2 --intermediate 8960 --vocab 151936 \
      --batch 8 --micro-batch 8 --prompt-len 1024 --response-len 1024 --dtype bfloat16 $ckpt \
      ${MEMORY_BUDGET:+--memory-budget $MEMORY_BUDGET} \
      --steps 4 --warmup 1 --json "$OUT/bench_train_step.json" --profile "$OUT/prof/train_step" \
      2> "$OUT/train_step.log" | tee -a "$OUT/summary.txt" ;;
  update_shape)
    # the GRPO experiment's actor update alone: 0.5B shape, 64 x (128 + 512) tokens in
    # micro-batches of UPDATE_MB rows, bf16, checkpointing; per backend and the hand loop
    timeout ${SECTION_TIMEOUT:-420} python3 experiments/bench/train_step.py --suite ${SUITE:-torch_fsdp,torch_fsdp+compile,jax_pjit,hf_torch} \
      --hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936 \
      --batch 64 --micro-batch ${UPDATE_MB:-64} --prompt-len 128 --response-len 512 --dtype bfloat16 $ckpt \
      --steps 3 --warmup 1 --json "$OUT/bench_update_shape.json" --profile "$OUT/prof/update_shape" \
      2> "$OUT/update_shape.log" | tee -a "$OUT/summary.txt" ;;
  grpo_torch|grpo_jax|grpo_split)
    model; backend=torch_fsdp; [ $s = grpo_jax ] && backend=jax_pjit
    split=()
    [ $s = grpo_split ] && split=(--gin_param 'polyrl.RunConfig.pools = {"a": {"CPU": 6, "GPU": 1}, "b": {"CPU": 6, "GPU": 1}}'
      --gin_param 'actor/polyrl.RoleConfig.pool = "a"' --gin_param 'polyrl.RolloutConfig.pool = "a"'
      --gin_param 'reference/polyrl.RoleConfig.pool = "b"')
    IFS=';' read -ra extra <<< "${GIN_EXTRA:-}"
    for b in ${extra[@]+"${extra[@]}"}; do split+=(--gin_param "${b#"${b%%[! ]*}"}"); done
    steps=${GRPO_STEPS:-4}; run_s=${GRPO_TIMEOUT:-$((steps * 60 + 220))}  # and one more, profiled
    peak_mem $s timeout $((run_s + 60)) python3 experiments/bench/grpo_step.py --gin gin/experiments/gpu_grpo_0p5b.gin \
      --backend $backend --steps $steps --skip 1 --timeout $run_s \
      --gin_param "polyrl.RunConfig.model_path = '$M'" \
      --gin_param "polyrl.RunConfig.weight_transport = '$transport'" ${split[@]+"${split[@]}"} \
      --log "$OUT/$s.log" --json "$OUT/bench_$s.json" --profile "$OUT/prof/$s" > "$OUT/$s.stdout" 2>&1
    cat "$OUT/$s.stdout" "$OUT/$s.mem.txt" | cut -c1-300 | tail -80 | tee -a "$OUT/summary.txt" ;;
  rollout)
    model
    timeout 540 python3 experiments/bench/rollout.py --model $M --json "$OUT/bench_rollout.json" ${ROLLOUT_ARGS:-} \
      --profile "$OUT/prof/rollout" 2> "$OUT/rollout.log" | tee -a "$OUT/summary.txt" ;;
  weight_sync)
    timeout 540 python3 experiments/bench/weight_sync.py --work /tmp/bench/sync --hidden 1536 --layers 28 \
      --heads 12 --kv-heads 2 --intermediate 8960 --vocab 151936 --dtype bfloat16 --sections export,sync,load \
      --bucket-mb ${SYNC_BUCKET_MB:-1024} --transports ${SYNC_TRANSPORTS:-object_store,cuda_ipc} \
      --out "$OUT/bench_weight_sync.json" --profile "$OUT/prof/weight_sync" 2> "$OUT/weight_sync.log" \
      | tail -12 | tee -a "$OUT/summary.txt" ;;
  async)
    model
    timeout 560 python3 experiments/bench/async_step.py --work /tmp/bench/async --steps ${ASYNC_STEPS:-6} \
      --gin_param "polyrl.RunConfig.model_path = '$M'" --out "$OUT/bench_async.json" --profile "$OUT/prof/async" \
      > "$OUT/async.log" 2>&1; tail -30 "$OUT/async.log" | tee -a "$OUT/summary.txt" ;;
  first_torch|first_jax)
    model; backend=torch_fsdp; [ $s = first_jax ] && backend=jax_pjit
    timeout 580 python3 experiments/bench/first_step.py --gin gin/experiments/gpu_grpo_0p5b.gin \
      --backend $backend --runs ${FIRST_RUNS:-cold,warm} --timeout 280 --cache-dir /tmp/polyrl-cache-$backend \
      --gin_param "polyrl.RunConfig.model_path = '$M'" --log-dir "$OUT/$s" \
      --json "$OUT/bench_$s.json" 2>&1 | tail -30 | tee -a "$OUT/summary.txt" ;;
  async_engine)
    model; am=${AE_MODEL:-$M}
    common=(--model $am --dtype bfloat16 --prompts 64 --n 8 --prompt-len 64 --new-tokens 512
      --max-model-len 1024 --gpu-memory-utilization 0.35 --turns 4 --obs-len 32 --calls 2)
    timeout 300 python3 experiments/bench/async_engine.py "${common[@]}" --modes llm,async --repeats 3 \
      --json "$OUT/bench_async_engine.json" 2> "$OUT/async_engine.log" | tee -a "$OUT/summary.txt"
    timeout 280 python3 experiments/bench/async_engine.py "${common[@]}" --no-engine --server \
      --server-engines sync,async --repeats 2 --json "$OUT/bench_async_server.json" \
      2>> "$OUT/async_engine.log" | tee -a "$OUT/summary.txt" ;;
  gsm8k_tool)
    # gin/experiments/gsm8k_tool.gin (episodes with the Python tool) against the single-turn
    # gsm8k_grpo.gin step on the same synthetic GSM8K-format rows and a random 0.5B shape
    # with 4096 positions: step time, generate time, rollout tokens/s, the episode metrics
    # (gsm8k_tool.py). GSM8K_ONLY: its --only, the runs (single: gsm8k_grpo.gin on vLLM's
    # synchronous engine, bound; single_async: as users get it, the asynchronous engine
    # every run takes; tool: the multi-turn run, every turn a sandbox run; tool_nosandbox: the same
    # turns and observations, no sandbox), default all four. A run takes ~2-2.5 minutes
    # (start-up ~75 s + 3 steps): the four do not fit one device call of 600 s; run
    # GSM8K_ONLY=single_async,tool (the multi-turn / single-turn ratio, same engine), then
    # GSM8K_ONLY=tool_nosandbox,single, and put the two JSONs in one table (with the
    # sandbox's share of generate) anywhere: gsm8k_tool.py --table A.json B.json. The JSON
    # is written after each run: a section stopped at SECTION_TIMEOUT keeps the runs done.
    M4K=/tmp/models/qwen2-0.5b-random-4k
    [ -d $M4K ] || python3 experiments/bench/random_model.py 0.5b $M4K --max-positions 4096 > "$OUT/make_0p5b_4k.log" 2>&1
    only=${GSM8K_ONLY:-single,single_async,tool,tool_nosandbox}
    left=$(( ${SECTION_TIMEOUT:-580} - SECONDS + start )); [ $left -gt 30 ] || left=30
    IFS=';' read -ra extra <<< "${GIN_EXTRA:-}"; args=()  # (every run's)
    for b in ${extra[@]+"${extra[@]}"}; do args+=(--gin_param "${b#"${b%%[! ]*}"}"); done
    timeout $left python3 experiments/bench/gsm8k_tool.py --model $M4K --steps ${GRPO_STEPS:-3} --skip 1 \
      --only $only ${args[@]+"${args[@]}"} --timeout 400 --log-dir "$OUT/gsm8k_tool_logs" --json "$OUT/bench_gsm8k_tool_${only//,/-}.json" \
      > "$OUT/gsm8k_tool_${only//,/-}.log" 2>&1
    tail -40 "$OUT/gsm8k_tool_${only//,/-}.log" | cut -c1-300 | tee -a "$OUT/summary.txt" ;;
  distill)
    # gin/experiments/gpu_distill_0p5b.gin: the GRPO experiment's step with a 1.5B-shape
    # teacher (random weights, the student's tokenizer) in place of the reference; run
    # grpo_torch beside it for the GRPO step on the same student
    model; T=/tmp/models/qwen2-1.5b-random-teacher
    if [ ! -d $T ]; then
      python3 experiments/bench/random_model.py 1.5b $T --max-positions 1024 > "$OUT/make_teacher.log" 2>&1
      (cd $T && rm -f tokenizer* special_tokens_map.json chat_template* vocab* merges*)
      cp $M/tokenizer* $M/special_tokens_map.json $T/ && cp $M/chat_template* $T/ 2>/dev/null
    fi
    IFS=';' read -ra extra <<< "${GIN_EXTRA:-}"; args=()
    for b in ${extra[@]+"${extra[@]}"}; do args+=(--gin_param "${b#"${b%%[! ]*}"}"); done
    steps=${GRPO_STEPS:-4}; run_s=${GRPO_TIMEOUT:-$((steps * 60 + 220))}
    peak_mem $s timeout $((run_s + 60)) python3 experiments/bench/grpo_step.py --gin gin/experiments/gpu_distill_0p5b.gin \
      --backend ${DISTILL_BACKEND:-torch_fsdp} --steps $steps --skip 1 --timeout $run_s \
      --gin_param "polyrl.RunConfig.model_path = '$M'" --gin_param "teacher/polyrl.RoleConfig.model_path = '$T'" \
      --gin_param "polyrl.RunConfig.weight_transport = '$transport'" ${args[@]+"${args[@]}"} \
      --log "$OUT/$s.log" --json "$OUT/bench_$s.json" > "$OUT/$s.stdout" 2>&1
    cat "$OUT/$s.stdout" "$OUT/$s.mem.txt" | cut -c1-300 | tail -60 | tee -a "$OUT/summary.txt" ;;
  tinker)
    # the Tinker service on the 0.5B shape, one GPU shared by the rollout server and the
    # training client (docs/tinker.md "On GPUs"): a LoRA step on the update's shape (64 x 640
    # tokens) and 64 sample calls x 8 x 512 tokens, against the engine and the pool
    model
    timeout ${SECTION_TIMEOUT:-420} python3 experiments/bench/tinker_overhead.py --backend ${TINKER_BACKEND:-torch_fsdp} \
      --gin_param "polyrl.RunConfig.model_path = '$M'" --gin_param 'polyrl.RunConfig.pools = {"shared": {"CPU": 8, "GPU": 1}}' \
      --gin_param "polyrl.RunConfig.model_dtype = 'bfloat16'" --gin_param "polyrl.RunConfig.gradient_checkpointing = True" \
      --gin_param "polyrl.RolloutConfig.dtype = 'bfloat16'" --gin_param "polyrl.RolloutConfig.gpu_memory_utilization = 0.35" \
      --gin_param "polyrl.RolloutConfig.max_model_len = 1024" --gin_param "polyrl.RolloutConfig.max_prompt_len = 128" \
      --gin_param "polyrl.TinkerConfig.max_training_clients = 2" --gin_param "polyrl.SamplingSpec.max_tokens = 512" \
      --ray-cpus 12 --batch 64 --length 640 --prompts 64 --samples 8 --prompt-len 64 --max-tokens 512 \
      --steps ${TINKER_STEPS:-3} --warmup 1 --json "$OUT/bench_tinker.json" 2> "$OUT/tinker.log" | tee -a "$OUT/summary.txt" ;;
  rollout_7b)
    M7=/tmp/models/qwen2-7b-random
    python3 experiments/bench/random_model.py 7b $M7 --max-positions 1024 > "$OUT/make_7b.log" 2>&1
    timeout 540 python3 experiments/bench/rollout.py --model $M7 --json "$OUT/bench_rollout_7b.json" \
      --gpu-memory-utilization 0.85 --repeats ${ROLLOUT_7B_REPEATS:-2} ${ROLLOUT_ARGS:-} \
      2> "$OUT/rollout_7b.log" | tee -a "$OUT/summary.txt" ;;
  gsm8k_tool_7b)
    # gin/experiments/gsm8k_tool_7b_lora.gin alone (gsm8k_tool.py --only tool): the GSM8K +
    # Python-tool episodes (up to 8192 tokens, every turn a sandbox run) on a random
    # Qwen2.5-7B shape with LoRA, every role on one GPU; GRPO_STEPS steps (default 3, the
    # first left out of the means): step time, phases, the update's MFU, peak GPU memory.
    # The whole section is bounded by SECTION_TIMEOUT (default 540 s: the model's build,
    # ~1 minute, comes first; then the run's start-up, ~2-3 minutes, and ~100 s a step:
    # estimates, gin/experiments/gsm8k_tool_7b_lora.gin). A run stopped at the bound is
    # measured over the steps it finished (grpo_step.py says so under its table).
    M7=/tmp/models/qwen2-7b-random-8k
    [ -d $M7 ] || python3 experiments/bench/random_model.py 7b $M7 --max-positions 8192 > "$OUT/make_7b_8k.log" 2>&1
    left=$(( ${SECTION_TIMEOUT:-540} - SECONDS + start )); [ $left -gt 30 ] || left=30
    peak_mem $s timeout $left python3 experiments/bench/gsm8k_tool.py --model $M7 --only tool \
      --tool-gin gin/experiments/gsm8k_tool_7b_lora.gin --steps ${GRPO_STEPS:-3} --skip 1 --timeout $((left - 20)) \
      --log-dir "$OUT" --json "$OUT/bench_gsm8k_tool_7b.json" > "$OUT/$s.stdout" 2>&1
    cat "$OUT/$s.stdout" "$OUT/$s.mem.txt" | cut -c1-300 | tail -40 | tee -a "$OUT/summary.txt" ;;
  shadow)
    # the three-way log-prob check's cost per step on the GRPO experiment (shadow_cost.py):
    # SHADOW_STEPS steps (default 12) with the check every SHADOW_EVERY (default 5)
    model
    timeout ${SECTION_TIMEOUT:-420} python3 experiments/bench/shadow_cost.py --gin gin/experiments/gpu_grpo_0p5b.gin \
      --steps ${SHADOW_STEPS:-12} --every ${SHADOW_EVERY:-5} --gin_param "polyrl.RunConfig.model_path = '$M'" \
      --json "$OUT/bench_shadow.json" 2> "$OUT/shadow.log" | tee -a "$OUT/summary.txt" ;;
  lora_sync)
    # a LoRA actor's weights to vLLM, merged (polyrl's way) vs vLLM adapters, 1.5B shape (lora_sync.py)
    timeout ${SECTION_TIMEOUT:-420} python3 experiments/bench/lora_sync.py --work /tmp/bench/lora_sync --hidden 1536 \
      --layers 28 --heads 12 --kv-heads 2 --intermediate 8960 --vocab 151936 --dtype bfloat16 \
      --prompts 64 --prompt-len 64 --new-tokens 128 --json "$OUT/bench_lora_sync.json" 2> "$OUT/lora_sync.log" \
      | tee -a "$OUT/summary.txt" ;;
  lora_7b)
    # the Qwen2.5-7B shape's update with LoRA (rank 16, every projection) on one GPU, per
    # backend; the random bf16 weights drawn on the GPU (random_model.py: seconds, where
    # train_step.py's own fp32 build on the host takes minutes and 30 GB of disk)
    M7=/tmp/models/qwen2-7b-random-2k
    [ -d $M7 ] || python3 experiments/bench/random_model.py 7b $M7 --max-positions 2048 > "$OUT/make_7b.log" 2>&1
    timeout ${SECTION_TIMEOUT:-420} python3 experiments/bench/train_step.py --suite ${SUITE:-torch_fsdp+lora,jax_pjit+lora} \
      --model $M7 --batch 8 --micro-batch 8 --prompt-len 1024 --response-len 1024 --dtype bfloat16 $ckpt \
      --steps 3 --warmup 1 --json "$OUT/bench_lora_7b.json" 2> "$OUT/lora_7b.log" | tee -a "$OUT/summary.txt" ;;
  attention_tests)
    # JAX_PLATFORMS set: the test session pins JAX to the CPU only when it is unset
    JAX_PLATFORMS=cuda,cpu timeout 300 python3 -m pytest -v -p no:cacheprovider -m gpu tests/backends/torch_fsdp/test_attention.py \
      tests/backends/jax_pjit/test_jax_packing.py 2>&1 | tee "$OUT/attention_tests.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" \
      | tee -a "$OUT/summary.txt" ;;
  sync_tests)
    timeout 300 python3 -m pytest -v -p no:cacheprovider -m gpu tests/rollout/test_gpu_transports.py -k "${SYNC_TESTS:-}" 2>&1 \
      | tee "$OUT/sync_tests.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" \
      | tee -a "$OUT/summary.txt" ;;
  compile_tests)
    timeout 540 python3 -m pytest -v -p no:cacheprovider tests/backends/torch_fsdp/test_compile.py 2>&1 \
      | tee "$OUT/compile_tests.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" \
      | tee -a "$OUT/summary.txt" ;;
  scale_tests)
    # 2 GPUs: a rollout server with tensor_parallel_size=2 (object store) and CUDA IPC from
    # every trainer rank, tiny GRPO runs per backend (tests/trainer/test_gpu_sync.py)
    timeout 480 python3 -m pytest -v -p no:cacheprovider -m gpu tests/trainer/test_gpu_sync.py \
      -k "${SCALE_TESTS:-tensor_parallel_server or cuda_ipc_from_every_rank}" 2>&1 | tee "$OUT/scale_tests.log" \
      | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" | tee -a "$OUT/summary.txt" ;;
  attention|ragged)
    shape="--hidden 1536 --layers 28 --heads 12 --kv-heads 2 --intermediate 8960 --vocab 151936 \
      --batch 8 --micro-batch 8 --prompt-len 1024 --response-len 1024 --dtype bfloat16 --grad-ckpt --steps 3 --warmup 1"
    runs=torch_fsdp,torch_fsdp@polyrl_varlen+pack,jax_pjit@xla,jax_pjit,jax_pjit+pack,hf_torch
    flag=""; [ $s = ragged ] && flag=--ragged && runs=torch_fsdp,torch_fsdp@polyrl_varlen+pack,jax_pjit,jax_pjit+pack,hf_torch
    timeout 580 python3 experiments/bench/train_step.py --suite $runs $shape $flag \
      --json "$OUT/bench_$s.json" 2> "$OUT/$s.log" | tee -a "$OUT/summary.txt" ;;
  *) echo "unknown section $s (tests train_step grpo_torch grpo_jax grpo_split rollout weight_sync async attention ragged attention_tests sync_tests scale_tests update_shape gsm8k_tool shadow lora_sync lora_7b first_torch first_jax async_engine rollout_7b compile_tests distill tinker gsm8k_tool_7b)" ;;
  esac
  pack_logs "$s"
done
