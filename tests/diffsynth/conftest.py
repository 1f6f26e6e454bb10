"""The diffsynth family's tests run only in the side environment (`make test` runs them there).

In the main environment (no diffsynth, by design) this folder is not collected; in the side one
(SPLITSTAGE_DIFFSYNTH_TESTS=1) diffsynth must import, else every test fails: never skipped.
"""

import os

import pytest

if os.environ.get("SPLITSTAGE_DIFFSYNTH_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One torch thread, local files only."""
    import torch

    torch.set_num_threads(1)
    monkeypatch.setenv("DIFFSYNTH_SKIP_DOWNLOAD", "True")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
