"""A shorter GIL switch interval while threads hand work to each other (I/O loop, encoder, V2).

CPython lets a thread waiting for the GIL take it only after the holder ran for the switch
interval (5 ms by default). fsspec's I/O loop needs the GIL for every socket write, so while an
encoder thread holds it the upload stalls; V2 retakes the GIL around every torch op. Measured on
the S3 writer over an 800 Mbit link: `write_shards` 0.80-0.84 of raw puts at 5 ms, 0.96-0.98
at 0.1 ms (`bench/bench_cache.py`). Nested and concurrent users share one setting: the shortest
asked for holds until the last one leaves, then the previous interval comes back. The setting
is the whole process's (the interpreter has one): its users are the cache store's batched writes
(`CacheStore.write_shards`) and stage 1's overlapped run (`stage1.overlap`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_active: list[float] = []  # the intervals asked for by the users inside
_previous = [0.0]  # the interval before the first of them


@contextlib.contextmanager
def shorter_switch_interval(seconds: float) -> Iterator[None]:
    """Run the block with the GIL switch interval at most `seconds` (restored after)."""
    with _lock:
        if not _active:
            _previous[0] = sys.getswitchinterval()
        _active.append(seconds)
        _set(min([_previous[0], *_active]))
    try:
        yield
    finally:
        with _lock:
            _active.remove(seconds)
            _set(min([_previous[0], *_active]))


def _set(seconds: float) -> None:
    """Set the interval to whole microseconds, as CPython keeps it (it truncates: setting back
    what it reported, e.g. 9.9e-05 for 1e-4, would shorten it by 1 us each time)."""
    sys.setswitchinterval((round(seconds * 1e6) + 0.5) / 1e6)
