#!/usr/bin/env bash
# A/B of `pagedllm bench` workloads in one call: the code at a base commit (unpacked into
# .whl/base by `git archive BASE pagedllm scripts | tar -x -C .whl/base`) against the working
# tree, alternating, on the same GPU. Usage:
#   OUT=logs bash scripts/gpu_ab.sh "decode-8b" "decode-8b --quantization fp8" ...
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-ab-logs}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
SITE=/tmp/ab-site
if ! env -u PYTHONPATH python3 -c "import gguf" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl 2>/dev/null
fi
for args in "$@"; do
    for tree in "$PWD/.whl/base" "$PWD"; do
        label=$([ "$tree" = "$PWD" ] && echo new || echo base)
        echo "== $label: bench $args"
        PYTHONPATH=$tree:$SITE python3 -P -c "import sys, pagedllm; print('pagedllm from', pagedllm.__file__, file=sys.stderr); from pagedllm.entrypoints.cli import main; sys.exit(main(['bench', *sys.argv[1:]]))" \
            $args --no-peer >"$OUT/ab.log" 2>&1
        rc=$?
        grep -E "pagedllm from|^pagedllm |tokens_per_s|share|ratio|valid|per constrained|^batch|Triton compiles|caching allocator|busy\) \|" "$OUT/ab.log"
        [ $rc -eq 0 ] || { echo "exit $rc:"; tail -5 "$OUT/ab.log"; }
    done
done
