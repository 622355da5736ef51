"""Building the CPU's C kernels survives a kill -9 half-way: the next build cleans up."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A compiler that writes its output file at once, then hangs: the kill lands mid-build.
FAKE_CC = """#!/bin/sh
[ "$1" = "--version" ] && { echo fakecc 1.0; exit 0; }
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && : > "$2"; shift; done
exec sleep 120
"""


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_a_build_killed_half_way_leaves_nothing_behind(tmp_path):
    cache, cc = tmp_path / "cache", tmp_path / "slowcc"
    cc.write_text(FAKE_CC)
    cc.chmod(0o755)
    env = dict(os.environ, PAGEDLLM_CACHE_DIR=str(cache), CC=str(cc), PYTHONPATH=str(REPO))
    code = "from pagedllm.kernels.cpu import build; build.load_library()"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not _files(cache) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the build process and its compiler
    proc.wait()
    (partial,) = _files(cache)  # what kill -9 left behind

    # The next process to build (here with a compiler that fails at once) removes it.
    env.update(CC="false")
    code = "from pagedllm.kernels.cpu import build; assert build.load_library() is None"
    subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True)
    assert not partial.exists() and _files(cache) == []
