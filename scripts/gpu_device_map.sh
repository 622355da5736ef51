#!/usr/bin/env bash
# Device-mapping runs on CUDA (issues "Device mapping" and "two GPUs"): greedy parity of mapped
# runs (fp32), and the 8B benchmarks with and without maps. Logs under $OUT.
# GPU_MAP_STEPS (comma list, default all): parity, two-gpu (needs 2 GPUs), one-gpu-map;
# GPU_MAP_REPEATS (default 2): alternated pairs of each comparison.
set -u
cd "$(dirname "$0")/.."
LOGS=${OUT:-$PWD/gpu-check-logs}
mkdir -p "$LOGS"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import gguf" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
bench() {
    python3 -c 'import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from pagedllm.entrypoints.cli import main
sys.exit(main(["bench", *sys.argv[1:]]))' "$@" --no-peer 2>&1 | grep -E "^pagedllm |KV cache:|cuda:.*layers|CUDA graphs:|bandwidth|error|Error"
}
# Engines alternate within a pair so drift on the machine hits both alike.
STEPS=${GPU_MAP_STEPS:-parity,two-gpu,one-gpu-map}
REPEATS=${GPU_MAP_REPEATS:-2}
TWO=$(python3 -c 'import torch; print(int(torch.cuda.device_count() >= 2))')
case ",$STEPS," in *,parity,*)
    echo "== parity (fp32, SmolLM2 shape)"
    python3 -m pytest -q -p no:cacheprovider -rP -m cuda tests/gpu/test_device_map.py 2>&1 \
        | grep -E "tok/s|passed|failed|skipped|Error" ;;
esac
case ",$STEPS,$TWO" in *,two-gpu,*1)
    for i in $(seq "$REPEATS"); do
        echo "== decode-8b, one GPU";               bench decode-8b --out /tmp/d0.json
        echo "== decode-8b, cuda:0:16,cuda:1:16";   bench decode-8b --device-map cuda:0:16,cuda:1:16 --out /tmp/d1.json
    done
    echo "== throughput-8b, one GPU";               bench throughput-8b --out /tmp/t2.json
    echo "== throughput-8b, cuda:0:16,cuda:1:16";   bench throughput-8b --device-map cuda:0:16,cuda:1:16 --out /tmp/t3.json ;;
esac
case ",$STEPS," in *,one-gpu-map,*)
    for i in $(seq "$REPEATS"); do
        echo "== throughput-8b, no map";            bench throughput-8b --out /tmp/t0.json
        echo "== throughput-8b, cuda:0:32";         bench throughput-8b --device-map cuda:0:32 --out /tmp/t1.json
    done ;;
esac
