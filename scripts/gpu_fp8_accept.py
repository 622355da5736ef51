"""Issue 16's H200 acceptance for FP8 weights, judged from gpu_check.sh's bench results:

    python scripts/gpu_fp8_accept.py DIR

DIR holds decode-8b.json, decode-8b-fp8.json, throughput-8b.json and throughput-8b-fp8.json
(`pagedllm bench ... --out`), measured in the same gpu_check.sh run. Targets:
decode-8b with --quantization fp8 >= 330 decode tok/s per request (bf16 measured 203), and
throughput-8b with fp8 not slower than bf16 (output tok/s). Exit status 1 when a target is
missed or a result is absent.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

DECODE_TARGET = 330.0  # tok/s, one request (decode-8b)


def load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def main() -> int:
    folder = Path(sys.argv[1])
    ok = True
    decode = {n: load(folder, n) for n in ("decode-8b", "decode-8b-fp8")}
    if all(decode.values()):
        bf16, fp8 = (decode[n]["summary"]["decode_tokens_per_s"] for n in decode)
        met = fp8 >= DECODE_TARGET
        ok &= met
        print(f"decode-8b: fp8 {fp8:.1f} tok/s, bf16 {bf16:.1f} tok/s ({fp8 / bf16:.2f}x); "
              f"target {DECODE_TARGET:g}: {'met' if met else 'MISSED'}")
    else:
        ok = False
        print("decode-8b: a result is missing: " + ", ".join(n for n, d in decode.items() if not d))
    tput = {n: load(folder, n) for n in ("throughput-8b", "throughput-8b-fp8")}
    if all(tput.values()):
        bf16, fp8 = (tput[n]["runs"][0]["output_tokens_per_s"] for n in tput)
        met = fp8 >= bf16
        ok &= met
        print(f"throughput-8b: fp8 {fp8:.1f} tok/s, bf16 {bf16:.1f} tok/s ({fp8 / bf16:.2f}x); "
              f"target not slower than bf16: {'met' if met else 'MISSED'}")
    else:
        ok = False
        print("throughput-8b: a result is missing: "
              + ", ".join(n for n, d in tput.items() if not d))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
