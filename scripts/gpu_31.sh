#!/usr/bin/env bash
# Issue 31 on one GPU in one call, every figure printed: the sort-free sampler and FP8 KV
# cache tests compiled on CUDA, then `pagedllm bench sharegpt` with PAGEDLLM_SAMPLER=sort and
# =sortfree (the A/B that picks the default), sortfree with an FP8 KV cache, with FP8 weights
# and FP8 KV, and `nano`. Usage: OUT=logs bash scripts/gpu_31.sh
#   GPU31_STEPS=tests,sharegpt-sort,...   a subset (default: all)
#   GPU31_PROMPTS=1000                    --num-prompts of the sharegpt runs
# The decode-attention split policy A/B (PAGEDLLM_DECODE_SPLIT=fill, the default, vs balance):
#   GPU31_STEPS=kernel-tests,kernel-gpu-tests,kernel-bench      correctness on CUDA, then the
#       kernel timings ("decode, mixed contexts": GB/s under each policy at the mix's shape)
#   GPU31_STEPS=sharegpt-sort,sharegpt-balance,nano,nano-balance   end to end, each pair in one run
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-31-logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SITE=$(mktemp -d /tmp/gpu31-site.XXXXXX)
if ! $PY -c "import gguf" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:$SITE
fi
STEPS=${GPU31_STEPS:-tests,gpu-tests,sharegpt-sort,sharegpt-sortfree,sharegpt-sortfree-kv8,sharegpt-fp8-kv8,nano}
N=${GPU31_PROMPTS:-1000}
BENCH=(-c "import logging, sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('pagedllm').setLevel(logging.INFO); from pagedllm.entrypoints.cli import main; sys.exit(main(['bench', *sys.argv[1:]]))")
FIGURES="GB/s|passed|failed|FAILED|ERROR|agreement|rows keep|chi-square|max \|fp8|^pagedllm|tok/s|_len:|sampler:|KV cache:|Traceback|Error"

# step NAME LIMIT_S SAMPLER COMMAND...: runs when NAME is in STEPS, prints its figures
step() {
    local name=$1 limit=$2 sampler=$3
    shift 3
    case ",$STEPS," in *",$name,"*) ;; *) return ;; esac
    echo "== $name (PAGEDLLM_SAMPLER=$sampler)"
    local start=$SECONDS
    PAGEDLLM_SAMPLER=$sampler timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    grep -E "$FIGURES" "$OUT/$name.log" | cut -c1-220
    echo "== $name: exit $rc in $((SECONDS - start)) s"
}

PYTEST=($PY -m pytest -q -p no:cacheprovider -rP)
step tests 300 sort "${PYTEST[@]}" tests/test_sortfree_sampler.py tests/test_fp8_kv_cache.py
step gpu-tests 600 sort "${PYTEST[@]}" -m cuda tests/gpu/test_sortfree_sampler.py \
    tests/gpu/test_fp8_kv_cache.py
SG=(sharegpt --num-prompts "$N")
step sharegpt-sort 420 sort $PY "${BENCH[@]}" "${SG[@]}" --out "$OUT/sharegpt-sort.json"
step sharegpt-sortfree 420 sortfree $PY "${BENCH[@]}" "${SG[@]}" --out "$OUT/sharegpt-sortfree.json"
step sharegpt-sortfree-kv8 420 sortfree $PY "${BENCH[@]}" "${SG[@]}" --kv-cache-dtype fp8 \
    --out "$OUT/sharegpt-sortfree-kv8.json"
step sharegpt-fp8-kv8 420 sortfree $PY "${BENCH[@]}" "${SG[@]}" --quantization fp8 \
    --kv-cache-dtype fp8 --out "$OUT/sharegpt-fp8-kv8.json"
step sharegpt-balance 420 sort env PAGEDLLM_DECODE_SPLIT=balance $PY "${BENCH[@]}" "${SG[@]}" \
    --out "$OUT/sharegpt-balance.json"
step kernel-tests 600 sort "${PYTEST[@]}" tests/test_kernels.py
step kernel-gpu-tests 600 sort "${PYTEST[@]}" -m cuda tests/gpu/test_parity.py \
    tests/gpu/test_kernel_checks.py tests/gpu/test_fp8_kv_cache.py
step kernel-bench 420 sort $PY "${BENCH[@]}" kernels
step nano-balance 420 sort env PAGEDLLM_DECODE_SPLIT=balance $PY "${BENCH[@]}" nano --no-peer \
    --out "$OUT/nano-balance.json"
# nano samples at a plain temperature (no top-k / top-p / min-p): the same path either way
step nano 420 sort $PY "${BENCH[@]}" nano --no-peer --out "$OUT/nano.json"
rm -rf "$SITE"
