"""Stage 2 launch: write the run spec, start torchrun (1..N nodes), stream output, report.

This process stays alive for the whole run (leases, torchrun's output, Ctrl-C, errors), so it
stays lean: the plan and the preflight checks, which import torch and the family and build meta
models, run once in a short-lived child (`prepare_child`), before any lease is taken.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from splitstage.config.job import ConfigError, SplitstageConfig, check_path_segment
from splitstage.splitter import UserError
from splitstage.tasks.stage2.lease import RunLease
from splitstage.tasks.stage2.outputs import (
    ERROR_FILE,
    URL_KEYS,
    deleted_place,
    leased_places,
    options_for,
)
from splitstage.tasks.stage2.prepare_child import WORKER_MODULE, prepare_in_child
from splitstage.tasks.stage2.torchrun import TorchrunError, TorchrunSpec, run_torchrun

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


def write_spec(
    config: SplitstageConfig,
    run_id: str,
    cache_key: str | None,
    run_dir: Path,
    paths: dict[str, str],
    checks: Any = None,
    split: dict[str, Any] | None = None,
    holds_lease: bool = True,
) -> Path:
    """The JSON every rank reads (no pickle): config, cache key, where to write, what to train,
    and the launcher's split (`split`), which each rank's own plan must equal. `checks` is a
    `Preflight` or the set-up child's `Prepared` (settings, and samples that `save` to a path)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    samples_file = None
    if checks is not None and checks.samples is not None:  # compact: 32 bytes a sample key
        samples_file = str((run_dir / "samples.safetensors").resolve())
        checks.samples.save(samples_file)
    spec = {
        "config": config.model_dump(mode="json"),
        "cache_key": cache_key,
        "run_id": run_id,
        **paths,
        "run_dir": str(run_dir.resolve()),
        # Checkpoints and outputs on object storage use the cache's endpoint options and, on
        # its store, its credentials block by name (each rank reads it): never a secret. Both
        # come in `paths` (run_paths resolved them once).
        "settings": checks.settings if checks is not None else None,
        "samples_file": samples_file,
        "split": split,
        "holds_lease": holds_lease,  # node 0's launcher holds the run's lease; others do not
    }
    path = run_dir / "spec.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


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
        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})},
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


def rank_error(run_dir: Path) -> str | None:
    """The one-line reason a rank wrote before exiting on bad input, if any."""
    path = run_dir / ERROR_FILE
    try:
        return json.loads(path.read_text())["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
    with contextlib.ExitStack() as held:
        staging = tempfile.TemporaryDirectory(prefix="splitstage-run-")
        held.callback(staging.cleanup)
        root = run_root or scratch_root(config)
        rank = torchrun_spec(config, None, node_rank, env)
        one_process = None if rank.uses_agent else rank  # the set-up child becomes the rank
        prepared = prepare_in_child(
            config, run_id, root, Path(staging.name), cancel, rank=one_process, on_line=say
        )
        if prepared.rank is not None:
            held.callback(prepared.rank.stop)  # stopped unless it trained (then a no-op)
        for warning in prepared.warnings:
            say(f"warning: {warning}")
        for note in prepared.notes:
            say(note)
        paths = prepared.paths
        run_dir = Path(paths["run_dir"])
        leases = [] if node_rank else hold_leases(config, paths, cancel, held)
        spec_path = write_spec(
            config,
            run_id,
            prepared.cache_key,
            run_dir,
            paths,
            prepared,
            split=prepared.split,
            holds_lease=bool(leases),
        )
        staging.cleanup()  # the child's request and reply: not kept for the whole run
        for name in ("result.json", ERROR_FILE):  # metrics.jsonl is the run's record: kept
            (run_dir / name).unlink(missing_ok=True)
        try:
            run_torchrun(
                torchrun_spec(config, spec_path, node_rank, env),
                timeout=timeout,
                on_line=say,
                cancel=cancel,
                check=True,
                started=prepared.rank,
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
                reason = rank_error(run_dir)
                gone = deleted_place(paths, bool(leases)) if reason is None else None
                if gone:  # its error.json went with it
                    reason = f"the folder {gone} was deleted while training"
                if reason is None:
                    raise
                raise TrainingStoppedError(f"training stopped: {reason}") from None
    result_file = run_dir / "result.json"
    figures = json.loads(result_file.read_text()) if result_file.is_file() else {}
    return TrainReport(
        run_id=run_id, run_dir=str(run_dir), **paths_without_run_dir(paths), **figures
    )


def hold_leases(
    config: SplitstageConfig, paths: dict[str, str], cancel: threading.Event, held
) -> list[RunLease]:
    """Hold the run (its output folder, and a checkpoint URL outside it) against a second
    `train` of the same run; losing the lease cancels this one."""
    return [
        held.enter_context(
            RunLease(
                paths[key],
                options_for(paths, key),
                ttl=LEASE_TTL_S,
                on_lost=lambda reason: cancel.set(),
            )
        )
        for key in leased_places(paths)
    ]


def check_run_id(run_id: str) -> str:
    """A run id is one or more folder names under output.url, none of which may escape it."""
    for segment in run_id.split("/"):
        try:
            check_path_segment(segment)
        except ValueError as error:
            raise ConfigError(f"run id {run_id!r}: {error}") from None
    return run_id


def paths_without_run_dir(paths: dict) -> dict[str, str]:
    """Output and checkpoint URLs."""
    return {key: paths[key] for key in URL_KEYS}
