"""A real `pagedllm serve --port 0 ARGS` in a child process, for the benchmarks that measure
the server as its clients see it (bench serve, bench quality).

Its output goes to a file, not a pipe: a pipe nobody reads once the URL is found fills up
and stalls the server. Stopped with SIGINT, as Ctrl-C, then killed if it does not exit."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])  # the pagedllm being measured


class ServerProcess:
    def __init__(self, args: list[str], timeout: float = 600.0) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-serve-", suffix=".log")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "0", *args],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        try:
            self.url = self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def served_model(self) -> str:
        """The first name of GET /v1/models (a server without --api-key)."""
        with urllib.request.urlopen(self.url + "/v1/models", timeout=60) as response:
            return json.load(response)["data"][0]["id"]

    def tail(self) -> str:
        lines = Path(self.log.name).read_text().strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def _wait_healthy(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`pagedllm serve` exited with {self.proc.returncode}: "
                                   f"{self.tail()}")
            if url is None:
                found = re.search(r" at (http://\S+)", Path(self.log.name).read_text())
                url = found.group(1) if found else None
            if url is not None:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=10) as response:
                        if response.status == 200:
                            return url
                except OSError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"`pagedllm serve` did not answer /health in {timeout:.0f} s")
