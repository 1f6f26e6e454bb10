"""Stage 2 launch: hold the run, write its spec, start torchrun (1..N nodes), stream, report.

One road for every job: this launcher, then torchrun's agent and its ranks (a job of one process
runs its rank directly, without the agent: `torchrun.py`). The launcher stays alive for the whole
run (leases, torchrun's output, Ctrl-C, errors), so it stays lean: configs and storage only, no
torch, no family. It checks what it can that way (the config, the run's places, that the outputs
can be written), holds the run's lease, and hands the ranks a typed `RunSpec`; each rank plans
once and rank 0 runs the heavy checks before any weight loads (`rank_setup.py`), leaving a
refusal's one line in the run folder, which this launcher raises again as the same error.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from splitstage.config.job import ConfigError, SplitstageConfig, check_path_segment
from splitstage.process.torchrun import TorchrunError, TorchrunSpec, run_torchrun
from splitstage.splitter import UserError
from splitstage.storage.lease import RunLease
from splitstage.tasks.stage2.outputs import ERROR_FILE, SET_UP, RunPlaces, check_outputs, run_places
from splitstage.tasks.stage2.run_spec import SPEC_FILE, RunSpec

WORKER_MODULE = "splitstage.tasks.stage2.worker"

MMAP_THRESHOLD = 1 << 20  # bytes: glibc maps allocations this large (see torchrun_spec)
LEASE_TTL_S = float(os.environ.get("SPLITSTAGE_LEASE_TTL", "60"))  # a dead holder blocks this long


@dataclass
class TrainReport:
    """What a training run did and where its weights are."""

    run_id: str
    run_dir: str
    output_url: str
    checkpoint_url: str
    outputs: dict[str, str] = field(default_factory=dict)
    samples: dict[str, str] = field(default_factory=dict)  # update -> validation grid URL
    grids: dict[str, list[str]] = field(default_factory=dict)  # update -> each size's grid URL
    updates: int = 0
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    stall_seconds: float = 0.0
    tail: dict[str, int] = field(default_factory=dict)  # per epoch: groups, dropped, repeated
    world_size: int = 1
    mode: str = "split"
    parallelism: str = "none"
    models_loaded: list[str] = field(default_factory=list)
    peak_rss_mb: float = 0.0  # rank 0's peak resident memory
    baseline_rss_mb: float = 0.0  # rank 0's resident memory after imports, before models

    def line(self) -> str:
        """One-line summary for the CLI."""
        loss = f"{self.losses[-1]:.5f}" if self.losses else "n/a"
        return (
            f"train {self.run_id}: {self.updates} updates on {self.world_size} rank(s) "
            f"({self.mode}, {self.parallelism}), final loss {loss}, {self.seconds:.1f} s; "
            f"weights: {', '.join(self.outputs.values()) or 'none'}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready report."""
        return asdict(self)


def prefect_api_env() -> dict[str, str]:
    """The Prefect API this process talks to when it is set in-process only (a flow, a test
    harness), so the ranks read credentials blocks where the launcher would."""
    settings = sys.modules.get("prefect.settings")  # never imported here for this
    if settings is None or "PREFECT_API_URL" in os.environ:
        return {}
    with contextlib.suppress(Exception):
        if url := settings.PREFECT_API_URL.value():
            return {"PREFECT_API_URL": str(url)}
    return {}


def torchrun_spec(
    config: SplitstageConfig,
    spec_path: Path | None,
    node_rank: int = 0,
    env: dict[str, str] | None = None,
) -> TorchrunSpec:
    """torchrun settings from `train.*`: nodes, processes per node, c10d rendezvous, restarts
    (no arguments for the worker while the run spec is not written yet)."""
    train = config.train
    return TorchrunSpec(
        module_or_script=WORKER_MODULE,
        args=[] if spec_path is None else [str(spec_path.resolve())],
        nnodes=train.nnodes,
        nproc_per_node=train.nproc_per_node,
        node_rank=node_rank,
        rdzv_endpoint=train.rdzv_endpoint,
        rdzv_id=config.job.name,
        max_restarts=train.max_restarts,
        # torchrun sets one OpenMP thread per worker only when nproc_per_node > 1; a single
        # worker with one thread per core fights the data prefetch thread (2-5 s/update vs 0.2 s).
        env={
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            # glibc's malloc moves its mmap threshold up as large blocks are freed, after which
            # a step's activations come from a heap it rarely returns: a rank's peak RSS then
            # varies run to run (SD 1.5 at real size, default settings: 1.30-1.37x the UNet
            # file). A fixed 1 MiB threshold maps every large tensor and returns it when freed
            # (1.33x in every run). The user's own setting wins.
            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD)),
            **prefect_api_env(),
            **(env or {}),
        },
    )


def scratch_root(config: SplitstageConfig) -> Path:
    """Where runs keep their spec, metrics and result: `train.scratch_dir`, else beside the
    outputs when those are local, else ./runs/train."""
    if config.train.scratch_dir:
        return Path(config.train.scratch_dir)
    url = config.output.url
    if "://" not in url or url.startswith("file://"):
        return Path(url.removeprefix("file://"))
    return Path("runs/train")


class TrainingStoppedError(UserError, RuntimeError):
    """A training rank refused to go on (a diverged loss, a config the checkpoint cannot take)."""


def rank_error(run_dir: Path) -> dict[str, Any] | None:
    """What a rank left before exiting on bad input (its one-line `message`; a refusal before
    training also its `phase` and error `classes`), if anything."""
    try:
        record = json.loads((run_dir / ERROR_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "message" in record else None


def user_error(message: str, classes: list[list[str]]) -> UserError:
    """`message` as the rank's error class, or the nearest base of it this process has
    imported (never importing one: that could be torch), down to `UserError`."""
    for module_name, qualname in classes:
        found: Any = sys.modules.get(module_name)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if not (isinstance(found, type) and issubclass(found, UserError)):
            continue
        try:
            error = found(message)
        except Exception:  # a class that takes other arguments: try its base
            continue
        if str(error) == message:
            return error
    return UserError(message)


def train(
    config: SplitstageConfig,
    *,
    run_id: str | None = None,
    node_rank: int = 0,
    run_root: str | Path | None = None,
    env: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    timeout: float | None = None,
) -> TrainReport:
    """Run stage 2 under torchrun to the end (resuming from the latest checkpoint) and report."""
    run_id = check_run_id(run_id or config.job.name)
    if not 0 <= node_rank < config.train.nnodes:
        raise ConfigError(
            f"--node-rank {node_rank}: the job has train.nnodes={config.train.nnodes} nodes, "
            f"so the node rank is 0..{config.train.nnodes - 1}"
        )
    say = on_line or print
    cancel = cancel or threading.Event()
    places = run_places(config, run_id, run_root or scratch_root(config))
    check_outputs(places)  # before the lease: a read-only output is refused, nothing held
    run_dir = Path(places.run_dir)
    with contextlib.ExitStack() as held:
        leases = [] if node_rank else hold_leases(places, cancel, held)
        for name in ("result.json", ERROR_FILE):  # metrics.jsonl is the run's record: kept
            (run_dir / name).unlink(missing_ok=True)
        spec = RunSpec(config=config, run_id=run_id, places=places, holds_lease=bool(leases))
        spec_path = spec.write(run_dir / SPEC_FILE)
        try:
            run_torchrun(
                torchrun_spec(config, spec_path, node_rank, env),
                timeout=timeout,
                on_line=say,
                cancel=cancel,
                check=True,
            )
        except TorchrunError:
            lost = next((lease.lost for lease in leases if lease.lost), None)
            finished = (run_dir / "result.json").is_file()  # the ranks wrote it last
            if lost and finished:  # stopped while the agent was exiting: the run is complete
                say(f"warning: the run finished, then its lease was lost ({lost})")
            elif lost:
                message = f"training stopped: the run's lease was lost ({lost})"
                raise TrainingStoppedError(message) from None
            else:
                raise_rank_error(run_dir, places, bool(leases))
    result_file = run_dir / "result.json"
    figures = json.loads(result_file.read_text()) if result_file.is_file() else {}
    return TrainReport(run_id=run_id, run_dir=str(run_dir), **places.urls(), **figures)


def raise_rank_error(run_dir: Path, places: RunPlaces, lease_held_here: bool) -> None:
    """Raise what stopped the ranks as one line: a refusal before training as the error it was
    (the same class, or its nearest imported base), a later stop on bad input as
    TrainingStoppedError; else the TorchrunError being handled."""
    record = rank_error(run_dir)
    if record is not None and record.get("phase") == SET_UP:
        if isinstance(failed := record.get("os"), dict):  # the CLI names its cause and path
            raise OSError(failed["errno"], failed["strerror"], failed["filename"]) from None
        raise user_error(record["message"], record.get("classes") or []) from None
    reason = None if record is None else record["message"]
    gone = places.deleted(lease_held_here) if reason is None else None
    if gone:  # its error.json went with it
        reason = f"the folder {gone} was deleted while training"
    if reason is None:
        raise  # noqa: PLE0704 - the TorchrunError being handled
    raise TrainingStoppedError(f"training stopped: {reason}") from None


def hold_leases(places: RunPlaces, cancel: threading.Event, held) -> list[RunLease]:
    """Hold the run (its output folder, and a checkpoint URL outside it) against a second
    `train` of the same run; losing the lease cancels this one."""
    return [
        held.enter_context(
            RunLease(
                places.url(key),
                places.options(key),
                ttl=LEASE_TTL_S,
                on_lost=lambda reason: cancel.set(),
            )
        )
        for key in places.leased()
    ]


def check_run_id(run_id: str) -> str:
    """A run id is one or more folder names under output.url, none of which may escape it."""
    for segment in run_id.split("/"):
        try:
            check_path_segment(segment)
        except ValueError as error:
            raise ConfigError(f"run id {run_id!r}: {error}") from None
    return run_id
