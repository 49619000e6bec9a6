#!/usr/bin/env bash
# The GPU checks of the GPU path (issue 6), for a lent H100/H200 machine. From the repo root:
#   here, once:  bash scripts/gpu_wheels.sh            (wheels the GPU image lacks, in .whl/)
#   there:       bash scripts/gpu_session.sh tests     (gpu-marked tests, kernel tests on CUDA, latency benches)
#                bash scripts/gpu_session.sh bench     (the throughput benchmarks and profiles)
#                bash scripts/gpu_session.sh tests latency latency-int4   (only the named steps, in that order)
#                bash scripts/gpu_session.sh lease     (LEASE_ORDER below: one lease's worth, most wanted first)
# With the device tool: run(command="bash scripts/gpu_session.sh lease", carry=[".whl"], timeout_s=600).
# Each step has its own time limit, so one hang cannot eat the whole call. FERRY_GPU_DEADLINE (a Unix time,
# e.g. $(($(date +%s) + 560)), shared by several invocations in one call; `lease` sets one 570 s ahead when
# none is given) bounds the whole run: a step gets at most what is left before it, and one with under 60 s
# left is skipped, so a call ends inside the device tool's limit with every finished step's log. Logs and
# JSON are written to $LOGS and packed after each step into $OUT/ferry-gpu.tgz (the device tool brings back
# 8 files at most).
set -uo pipefail
case ${1:-} in tests | bench | lease) ;; *)
  echo "usage: $0 tests|bench|lease [STEP ...]" >&2
  exit 2
  ;;
esac
# The steps one 15-minute lease should run first (2026-11-27, after the fifth lease: the word GEMV, for
# issue 15's int4 target, in the sweep and in a whole model, and the packed decode tiles; the MoE tiles
# it set, in whole models).
# Two calls: the first ~570 s, the second what is left on the warm machine.
LEASE_ORDER="gpu-tests kernel-tests gguf-sweep latency-int4 latency-int4-words latency-int4-packed
  profile-int4-b1-words throughput-qwen3-moe moe-sweep throughput-deepseek-v2-lite moe-vs-dense latency latency-int8 throughput-llama"
[[ $1 == lease && -z ${FERRY_GPU_DEADLINE:-} ]] && FERRY_GPU_DEADLINE=$(($(date +%s) + 570))
GROUP=$1
ASKED="${*:2}"
OUT=${OUT:-/tmp/ferry-gpu}
DEADLINE=${FERRY_GPU_DEADLINE:-$(($(date +%s) + 100000))}
# One folder per deadline: the invocations of one call share it (its tarball holds all their logs); a
# later call on the same warm machine starts a fresh one.
LOGS=/tmp/ferry-gpu-steps-$DEADLINE
mkdir -p "$LOGS" "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  wheels=$(ls .whl)  # installed once per machine, again if the carried wheels change
  if [[ $(cat /tmp/site/.ferry-wheels 2>/dev/null) != "$wheels" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 1
    echo "$wheels" >/tmp/site/.ferry-wheels
  fi
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$LOGS/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$LOGS/gpu.txt"
cat "$LOGS/gpu.txt"
tar czf "$OUT/ferry-gpu.tgz" -C "$LOGS" .
ferry() { python3 -m ferry.cli "$@"; }
declare -A LIMIT CMD GROUP_OF
ORDER=()
step() {  # step NAME SECONDS COMMAND...: register a step of the current group (run_step runs it)
  local name=$1
  LIMIT[$name]=$2
  shift 2
  CMD[$name]=$(printf '%q ' "$@")
  GROUP_OF[$name]=$DEFINING
  ORDER+=("$name")
}
run_step() {  # run_step NAME: run with its limit, log to $LOGS/NAME.log, report its status
  local name=$1 limit=${LIMIT[$1]}
  local left=$((DEADLINE - $(date +%s) - 10))
  if ((left < 60)); then
    echo "=== $name: skipped, ${left}s left before FERRY_GPU_DEADLINE"
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
  local t0=$SECONDS
  eval "timeout $limit ${CMD[$name]}" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$LOGS/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
  tar czf "$OUT/ferry-gpu.tgz" -C "$LOGS" .
}
export -f ferry
DEFINING=tests
step gpu-tests 240 python3 -m pytest -q -m gpu tests/gpu tests/test_hf_parity.py -p no:cacheprovider
# the Triton kernels' tests on CUDA (tests/engine's Triton-vs-torch tests are CPU tests: the interpreter,
# in CI; the C++ CPU kernels' tests run in CI too)
# (they compile ~100 kernels: 2026-11-26 on an H100, over 120 s with Triton's cache cold, 27 s warm)
step kernel-tests 300 bash -c "python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_*.py \
   tests/kernels/test_kv_quant.py"  # test_compile_check.py: CI compiles for sm_90 without a GPU
step latency 200 bash -c "ferry bench latency --model llama-3.1-8b --load-format dummy --batch-sizes 1 64 256 \
  --json $LOGS/latency.json"
step latency-eager 150 bash -c "ferry bench latency --model llama-3.1-8b --load-format dummy --batch-sizes 1 64 \
  --enforce-eager --json $LOGS/latency-eager.json"
# int4: random Q4_0 projections (GPTQ int4's layout after conversion) on the Triton GGUF kernels;
# the target is >= 70% of peak HBM bandwidth per decode step at batch 1.
step latency-int4 200 bash -c "ferry bench latency --model llama-3.1-8b --load-format dummy --quantization gguf \
  --batch-sizes 1 16 64 --json $LOGS/latency-int4.json"
# the same with the word GEMV (~4 instructions a weight value against ~8; FERRY_GGUF_GEMV_WORDS=1 sets
# triton_gguf.GEMV_WORDS), at batch 1 where the GEMV runs
step latency-int4-words 150 bash -c "FERRY_GGUF_GEMV_WORDS=1 ferry bench latency --model llama-3.1-8b \
  --load-format dummy --quantization gguf --batch-sizes 1 --json $LOGS/latency-int4-words.json"
# decode tiles (2-16 rows) with packed nibbles (FERRY_GGUF_PACKED_DEQUANT=1: 7.3 instructions a value
# against 10.6 in their sm_90 SASS), beside latency-int4's batch 16 with the plain tiles
step latency-int4-packed 150 bash -c "FERRY_GGUF_PACKED_DEQUANT=1 ferry bench latency --model llama-3.1-8b \
  --load-format dummy --quantization gguf --batch-sizes 4 16 --json $LOGS/latency-int4-packed.json"
# where an int4 batch-1 step's device time goes, by kernel (one request, CUDA graphs; 2026-11-27: the
# GEMVs 75%, the bf16 head 9%, ~10 small kernels a layer the rest), with the float GEMV and the word one
step profile-int4-b1 120 bash -c "ferry bench throughput --model llama-3.1-8b --load-format dummy --quantization gguf \
  --num-prompts 1 --input-len 128 128 --output-len 64 64 --no-hf --torch-profile 20 --json $LOGS/profile-int4-b1.json"
step profile-int4-b1-words 120 bash -c "FERRY_GGUF_GEMV_WORDS=1 ferry bench throughput --model llama-3.1-8b \
  --load-format dummy --quantization gguf --num-prompts 1 --input-len 128 128 --output-len 64 64 --no-hf \
  --torch-profile 20 --json $LOGS/profile-int4-b1-words.json"
# the int4 GEMV alone: default tiles, the best of a sweep, cuBLAS bf16 and the bytes floor per shape
step gguf-sweep 300 python3 scripts/gguf_gemv_sweep.py
step compile-check-gguf 120 python3 -m ferry.tools.compile_check --model llama-3.1-8b --quantization gguf
# int8 W8A8 (SmoothQuant-calibrated, Triton int8 GEMM): 1 byte a weight read per decode step.
step latency-int8 200 bash -c "ferry bench latency --model llama-3.1-8b --load-format dummy --quantization int8 \
  --batch-sizes 1 16 64 --json $LOGS/latency-int8.json"
# speculative decoding (issue 16): a step verifying 4 drafts per request against a plain decode
# step, batch 1..64; also shows whether verify steps (decode-only plans) take the CUDA graphs
step spec-verify-cost 200 bash -c "ferry bench spec --verify-cost --model llama-3.1-8b --load-format dummy \
  --batch-sizes 1 4 16 64 --drafts 4 --json $LOGS/spec-verify-cost.json"
DEFINING=bench
step throughput-qwen3 280 bash -c "ferry bench throughput --model qwen3-0.6b --load-format dummy --num-prompts 256 \
  --input-len 100 1024 --output-len 100 1024 --hf-num-prompts 32 --json $LOGS/qwen3.json"
step throughput-llama 280 bash -c "ferry bench throughput --model llama-3.1-8b --load-format dummy \
  --dataset sharegpt-like --no-hf --json $LOGS/sharegpt.json"
# issue 19: Qwen3-30B-A3B's shape (61 GB of bf16 weights: the H200 leaves room for KV), grouped experts
# (the fused-MoE Triton kernels, in CUDA graphs); vLLM publishes figures for this model to set beside it
step throughput-qwen3-moe 400 bash -c "ferry bench throughput --model qwen3-30b-a3b --load-format dummy \
  --dataset sharegpt-like --no-hf --json $LOGS/sharegpt-moe.json"
# the fused-MoE GEMMs' tiles (untuned 64x64 so far; 52-60% of DeepSeek-V2-Lite's device time, fourth lease)
step moe-sweep 300 python3 scripts/moe_gemm_sweep.py
step moe-vs-dense 300 bash -c "ferry bench moe --device cuda --dtype bfloat16 --json $LOGS/moe-vs-dense.json"
# DeepSeek-V2-Lite's shape (31 GB of bf16 weights): MLA on the Triton backend (kernels/triton_mla.py) in CUDA
# graphs; 2026-11-26 it ran the torch backend, eagerly: 1,551 tok/s
step throughput-deepseek-v2-lite 400 bash -c "ferry bench throughput --model deepseek-v2-lite --load-format dummy \
  --dataset sharegpt-like --no-hf --json $LOGS/sharegpt-deepseek-v2-lite.json"
# where a step's time goes, by operator (torch.profiler; bench/torch_profile.py): 2026-11-26 DeepSeek-V2-Lite's
# steps with prefill took 226 ms each (2,208 prompt tok/s) against 16 ms for decode-only ones
step profile-deepseek-v2-lite 240 bash -c "ferry bench throughput --model deepseek-v2-lite --load-format dummy \
  --dataset sharegpt-like --num-prompts 256 --no-hf --torch-profile 5 --json $LOGS/profile-deepseek-v2-lite.json"
step profile-llama 200 bash -c "ferry bench throughput --model llama-3.1-8b --load-format dummy \
  --dataset sharegpt-like --num-prompts 256 --no-hf --torch-profile 5 --json $LOGS/profile-llama.json"
# int8 W8A8 decode ran 13-40% slower on 2026-11-26 than on 11-23 (BENCHMARKS.md): its operators
step profile-llama-int8 200 bash -c "ferry bench throughput --model llama-3.1-8b --load-format dummy \
  --quantization int8 --dataset sharegpt-like --num-prompts 256 --no-hf --torch-profile 5 \
  --json $LOGS/profile-llama-int8.json"
step mla-vs-gqa 300 bash -c "ferry bench mla --device cuda --dtype bfloat16 --context 4096 --json $LOGS/mla-vs-gqa.json"

if [[ $GROUP == lease ]]; then
  selected=$LEASE_ORDER
elif [[ -n $ASKED ]]; then
  selected=$ASKED
else
  selected=$(for n in "${ORDER[@]}"; do [[ ${GROUP_OF[$n]} == "$GROUP" ]] && echo "$n"; done)
fi
for name in $selected; do
  if [[ -z ${LIMIT[$name]:-} ]]; then
    echo "=== $name: no such step" >&2
    continue
  fi
  run_step "$name"
done
