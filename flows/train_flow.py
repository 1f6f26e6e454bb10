"""The `train` flow: stage 2 under torchrun, with its output streamed to the run log.

Deployable on its own (`train/multinode`: one flow run per job, torchrun on every node, see
flows/multinode.py). Each run trains into a versioned folder, writes `train-report.json` next to
the weights, then moves the job's `latest.json` pointer; a cancel ends the whole process tree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Cancelled

from splitstage.config.job import SplitstageConfig
from splitstage.flows.artifacts import (
    Progress,
    artifact_key,
    is_top_level_run,
    publish_loss_curve,
    publish_plan,
    publish_samples,
)
from splitstage.flows.cancel import cancel_event, stop_training
from splitstage.flows.multinode import apply_node_env
from splitstage.flows.task_wrappers import plan_job, train_task
from splitstage.flows.versioned_outputs import current_version, run_id_for, warm_start, write_latest
from splitstage.process.torchrun import TorchrunError
from splitstage.storage.files import join, write_atomic
from splitstage.tasks.launch.launcher import TrainReport
from splitstage.tasks.stage2.outputs import open_output
from splitstage.tasks.stage2.run_records import read_metrics

REPORT_FILE = "train-report.json"
_UPDATE = re.compile(r"\bupdate (\d+)/(\d+)\b")
_SAMPLES = re.compile(r"\bsamples update (\d+): (\S+)")


def log_lines(progress: Progress, config: SplitstageConfig) -> Callable[[str], None]:
    """torchrun output -> the run log; `update N/M` lines move the progress artifact and
    `samples update N: URL` lines publish the validation grid."""
    logger = get_run_logger()

    def on_line(line: str) -> None:
        logger.info(line)
        if match := _UPDATE.search(line):
            progress.set(int(match[1]), int(match[2]))
        if match := _SAMPLES.search(line):
            publish_samples(config, int(match[1]), match[2])

    return on_line


def write_report(config: SplitstageConfig, report: TrainReport, extra: dict[str, Any]) -> str:
    """`<output>/train-report.json` (figures, losses, weights): the run's record; its URL."""
    url = report.output_url
    fs, root = open_output(config, url)
    write_atomic(fs, join(root, REPORT_FILE), json.dumps({**report.to_dict(), **extra}).encode())
    return f"{url.rstrip('/')}/{REPORT_FILE}"


@flow(
    name="train",
    on_cancellation=[stop_training],
    on_crashed=[stop_training],
)
def train_flow(
    config: SplitstageConfig,
    version: str | None = None,
    versioned: bool = True,
    warm_start_from_latest: bool = False,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Stage 2: train the weight-dependent part from the stage-1 cache; publish the loss curve.

    `version` names the output folder (default: this flow run's); `versioned=False` trains in
    `<output.url>/<job.name>` and resumes its checkpoints across runs.
    """
    logger = get_run_logger()
    version = version or (current_version() if versioned else None)
    run_id = run_id_for(config, version)
    config, node_rank = apply_node_env(config)
    warm_from = None
    if warm_start_from_latest:
        config, warm_from = warm_start(config)
        logger.info(
            f"warm start from {warm_from}"
            if warm_from
            else "warm start skipped: no earlier versioned run of fully trained models that load "
            "from local weight files (LoRA and builder models cannot be loaded from an export yet)"
        )
    if is_top_level_run() and node_rank == 0:
        publish_plan(plan_job(config))
    progress = Progress(artifact_key(config, "train-progress"), f"Training {run_id}")
    with cancel_event() as cancel:
        try:
            report = train_task(
                config, run_id, log_lines(progress, config), cancel, timeout_s, node_rank=node_rank
            )
        except TorchrunError as error:
            if error.result.cancelled:
                return Cancelled(message=f"training {run_id} cancelled; torchrun tree stopped")
            raise
    progress.finish()
    logger.info(report.line())
    if node_rank != 0:
        return report.to_dict()
    records = read_metrics(Path(report.run_dir))  # the run's record, every launch included
    norms = [record["grad_norm"] for record in records if "grad_norm" in record]
    publish_loss_curve(config, report.losses, norms)
    extra = {"version": version, "warm_start_from": warm_from}
    extra["report_url"] = write_report(config, report, extra)
    extra["latest"] = write_latest(config, version, report, extra) if version else None
    return {**report.to_dict(), **extra}
