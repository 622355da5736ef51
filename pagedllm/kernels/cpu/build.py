"""Compile the C kernels of this folder into one shared library, once per machine.

The library is built with the system C compiler the first time a CPU kernel is asked for
(well under a second), cached under ~/.cache/pagedllm (or $PAGEDLLM_CACHE_DIR) by a hash of
the sources, the compiler and the CPU, and loaded with ctypes. It is built for this CPU
(-march=native) and threaded with OpenMP: the soname is the one torch loads, so both share
one OpenMP runtime and its threads.

No compiler, a failed build, or PAGEDLLM_CPU_KERNELS=0: load_library() returns None and the
CPU path stays pure torch (kernels/reference.py), with one warning saying why.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -fno-math-errno as torch is built; -ffp-contract=off: a*b + c*d rounds as the torch ops do
# (explicit FMA intrinsics still fuse).
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-fPIC",
         "-shared", "-std=c11"]
TMP_SUFFIX = ".so.tmp"


def cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm"
    return Path(root) / "cpu_kernels"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in [version, " ".join(FLAGS), _cpu_identity(), platform.machine()]:
        digest.update(part.encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    return cache_dir() / f"pagedllm_cpu_{digest.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(target.parent)
    # Build beside the target, then rename: processes building at once never load a torn file.
    # The name carries our pid, so a build killed half-way (kill -9) is cleaned up later.
    tmp = target.parent / f"{target.stem}.{os.getpid()}{TMP_SUFFIX}"
    try:
        cmd = [compiler, *FLAGS, *map(str, SOURCES), "-o", str(tmp), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_stale_builds(folder: Path) -> None:
    """Delete the temp files of builds whose process is gone or that are over an hour old
    (tmp*.so, the temp names of earlier versions, carry no pid: by age only)."""
    for path in [*folder.glob(f"*{TMP_SUFFIX}"), *folder.glob("tmp*.so")]:
        pid = path.name.removesuffix(TMP_SUFFIX).rpartition(".")[2]
        try:
            dead = pid.isdigit() and not _process_alive(int(pid))
            if dead or time.time() - path.stat().st_mtime > 3600:
                path.unlink()
        except OSError:  # removed by another process meanwhile
            pass


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


@functools.cache
def load_library() -> ctypes.CDLL | None:
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found ($CC or cc): the CPU runs the pure-torch kernels")
        return None
    import torch  # noqa: F401 - loads torch's OpenMP runtime first, for the library to share

    try:
        path = _library_path(compiler)
        if not path.exists():
            _build(compiler, path)
            logger.info("built the CPU kernels: %s", path)
        return ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("could not build the CPU kernels, the CPU runs the pure-torch "
                       "kernels: %s", exc)
        return None
