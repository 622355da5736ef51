"""pagedllm.startup.paused_gc: the collector off inside the block and back on after it, the
block's objects frozen only when asked, and a fresh `from pagedllm import LLM` leaves the
collector running."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.startup import paused_gc

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


def test_off_inside_on_after(thawed) -> None:
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_on_again_after_an_exception(thawed) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with paused_gc():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_nested_and_already_off_stay_off(thawed) -> None:
    with paused_gc():
        with paused_gc(freeze=True):
            pass
        assert not gc.isenabled()  # the outer block still runs
    assert gc.isenabled()
    gc.disable()
    with paused_gc(freeze=True):
        pass
    assert not gc.isenabled()  # the caller's choice is kept
    assert gc.get_freeze_count() == 0  # and nothing frozen behind its back


def test_freeze_moves_the_block_objects_to_the_permanent_generation(thawed) -> None:
    with paused_gc(freeze=True):
        made = [[i] for i in range(1000)]
    assert gc.get_freeze_count() >= len(made)
    assert gc.isenabled()


def test_import_leaves_the_collector_running() -> None:
    code = ("import gc; from pagedllm import LLM, SamplingParams; "
            "assert gc.isenabled(), 'collector left off'; print(gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 10_000  # torch's modules, frozen once imported


@pytest.mark.parametrize("env, expected", [({}, "False"),
                                           ({"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}, "True")])
def test_torch_backend_autoload_off_unless_asked(env: dict, expected: str) -> None:
    """pagedllm turns off torch's scan for out-of-tree device backends; a user's own
    setting wins."""
    code = "import pagedllm, torch; print(torch._is_device_backend_autoload_enabled())"
    base = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**base, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
