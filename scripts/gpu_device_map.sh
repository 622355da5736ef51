#!/usr/bin/env bash
# Device-mapping runs on CUDA (issues "Device mapping" and "two GPUs"): greedy parity of mapped
# runs (fp32), and the 8B benchmarks with and without maps, in one call. Logs under $OUT.
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
sys.exit(main(["bench", *sys.argv[1:]]))' "$@" --no-peer 2>&1 | grep -E "^pagedllm |KV cache:|cuda:.*layers|error"
}
echo "== parity (fp32, SmolLM2 shape)"; python3 scripts/gpu_device_map.py --out "$LOGS/device_map.json" 2>&1 | grep "^{"
echo "== throughput-8b, no map";            bench throughput-8b --out /tmp/t0.json
echo "== throughput-8b, cuda:0:32";         bench throughput-8b --device-map cuda:0:32 --out /tmp/t1.json
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    echo "== decode-8b, one GPU, eager";     bench decode-8b --enforce-eager --out /tmp/d0.json
    echo "== decode-8b, cuda:0:16,cuda:1:16"; bench decode-8b --device-map cuda:0:16,cuda:1:16 --out /tmp/d1.json
    echo "== throughput-8b, one GPU, eager"; bench throughput-8b --enforce-eager --out /tmp/t2.json
    echo "== throughput-8b, cuda:0:16,cuda:1:16"; bench throughput-8b --device-map cuda:0:16,cuda:1:16 --out /tmp/t3.json
fi
