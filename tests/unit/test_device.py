"""tasks/device.py: `steady_heap` keeps a CPU forward's transient buffers from staying resident,
and leaves a threshold the user chose alone. Each case runs in a fresh process (the setting is
per process and cannot be undone)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A forward's pattern: a large block freed (glibc's dynamic threshold rises past 1 MiB), then
# per layer a 1 MiB transient freed and a small tensor kept (hidden states), 200 layers.
PATTERN = """
import torch
from splitstage.tasks.device import resident_mb, steady_heap
print(steady_heap())
big = torch.ones(8 * 2**20, dtype=torch.uint8)
del big
before, kept = resident_mb(), []
for _ in range(200):
    transient = torch.ones(2**20, dtype=torch.uint8)
    kept.append(torch.ones(16 * 1024, dtype=torch.uint8))
    del transient
print(resident_mb() - before)
"""

USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")  # this shell's, not the test's

pytestmark = pytest.mark.skipif(
    not hasattr(os, "confstr") or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""),
    reason="glibc's malloc only",
)


def run_pattern(**env: str) -> tuple[str, float]:
    """steady_heap's answer and the pattern's resident growth in MiB, in a fresh process."""
    clean = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    done = subprocess.run(
        [sys.executable, "-c", PATTERN],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    answer, growth = done.stdout.split()
    return answer, float(growth)


def test_steady_heap_returns_transient_buffers():
    answer, growth = run_pattern()
    assert answer == "True"
    assert growth < 40, f"{growth:.0f} MiB stayed resident after 200 freed 1 MiB buffers"


def test_a_threshold_the_user_chose_is_kept():
    answer, _ = run_pattern(MALLOC_MMAP_THRESHOLD_="1048576")
    assert answer == "False"
