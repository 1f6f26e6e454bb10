"""Small torchrun workers for the launcher tests.

Run: torchrun --nproc-per-node=2 tests/integration/workers/launch_worker.py MODE
MODE: fail (rank 1 raises), fail-record (same under torchelastic's @record), raise (every rank
raises at once; raise-record under @record), sleep (print pids, spawn a grandchild, sleep
forever), allreduce (gloo all_reduce of ranks, print the sum).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from splitstage.process.leaving import leave


def fail() -> None:
    """Rank 1 raises a ValueError; rank 0 waits to be stopped."""
    rank = int(os.environ["RANK"])
    marker = (
        Path(tempfile.gettempdir()) / f"launch-worker-{os.getppid()}"
    )  # the agent's pid: shared by the ranks
    print(f"rank {rank} starting", flush=True)
    if rank == 0:
        marker.touch()
    if rank == 1:
        deadline = time.monotonic() + 20
        while not marker.exists() and time.monotonic() < deadline:  # rank 0 has printed first
            time.sleep(0.05)
        marker.unlink(missing_ok=True)
        raise ValueError("boom-rank1: bad value in the worker")
    time.sleep(30)  # torchrun stops this rank once rank 1 failed


def raise_now() -> None:
    """Say which rank of how many this is, then raise a ValueError naming the rank."""
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    print(f"rank {rank} of {world} starting", flush=True)
    raise ValueError(f"boom-rank{rank}: bad value in the worker")


def sleep() -> None:
    """Print this worker's and a grandchild's pid, then hang."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"PIDS {os.getpid()} {child.pid}", flush=True)
    time.sleep(600)


def allreduce() -> None:
    """Sum the ranks over gloo and print world size, rank and sum."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    print(
        f"WORLD {dist.get_world_size()} RANK {dist.get_rank()} SUM {int(value.item())}", flush=True
    )
    dist.destroy_process_group()


def main() -> None:
    """Dispatch on MODE."""
    mode = sys.argv[1]
    modes = {"fail": fail, "raise": raise_now, "sleep": sleep, "allreduce": allreduce}
    if mode.endswith("-record"):
        from torch.distributed.elastic.multiprocessing.errors import record

        record(modes[mode.removesuffix("-record")])()
        return
    modes[mode]()


if __name__ == "__main__":
    main()
    leave(0)  # as a rank leaves: no interpreter teardown, where torch threads can abort
