"""What a process does before its first token, kept cheap.

paused_gc(): Python's cyclic garbage collector waits while the process imports torch (and
the server's libraries) and builds an engine. Those steps create hundreds of thousands of
long-lived objects and almost no garbage; every full collection on the way rescans all of
them, so a start spends a noticeable share of its time in collections that free nothing.

Objects made while the collector is off all stay in its youngest generation, and the first
collection after it scans them all at once; `freeze=True` moves them to the permanent
generation instead (gc.freeze), for imports: a module lives as long as the process.
An engine's build is not frozen here: a dropped engine must stay collectable (the engine
freezes the heap itself at its first step and unfreezes it at shutdown, engine/core.py).
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc(freeze: bool = False) -> Iterator[None]:
    if not gc.isenabled():  # off already (the caller's choice, or an outer paused_gc)
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        gc.enable()
