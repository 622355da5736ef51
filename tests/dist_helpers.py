"""Multi-process runs for the tensor-parallel tests: each rank a process of its own, as
torchrun (or two machines) would start them, on a free localhost port."""
from __future__ import annotations

import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(commands: list[list[str]], envs: list[dict[str, str]],
              timeout: float = 300) -> list[str]:
    """Run one process per rank (`commands[i]` under `envs[i]`, in the repository), wait
    for all of them, and return their stdouts; each must exit 0 (else its stderr's tail is
    the failure)."""
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for cmd, env in zip(commands, envs)]
    try:
        results = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in results]
