#!/usr/bin/env bash
# Where a benchmark's time goes on the host: `pagedllm bench WORKLOAD` under cProfile (the
# numbers it prints are slowed by the profiler; compare shares, not rates). Usage:
#   bash scripts/gpu_profile_step.sh nano [bench options...]
set -u
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import gguf" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 - "$@" <<'PY'
import cProfile, pstats, sys
from pagedllm.entrypoints.cli import main
profile = cProfile.Profile()
profile.runcall(main, ["bench", *sys.argv[1:], "--no-peer"])
pstats.Stats(profile).sort_stats("tottime").print_stats(35)
PY
