"""What a benchmark ran on and when, for the `--out` JSON files (`pagedllm bench render`
writes them into docs/benchmarks.md with their command, machine and date)."""
from __future__ import annotations

import os
import platform
import shlex
import time
from typing import Any


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host() -> dict[str, Any]:
    """The CPU, its cores, the GPUs (none without CUDA) and the load average at the time."""
    info: dict[str, Any] = {"cpu": cpu_name(), "cores": os.cpu_count(),
                            "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):
        info["load_average"] = round(os.getloadavg()[0], 2)
    return info


def stamp(argv: list[str], workload: str) -> dict[str, Any]:
    """`date` (UTC), `command` (as typed: `pagedllm bench WORKLOAD ARGS`) and `host`."""
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": shlex.join(["pagedllm", "bench", workload, *argv]), "host": host()}
