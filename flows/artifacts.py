"""The dashboard: Prefect artifacts for the plan, the cache, progress, the loss curve and a summary.

Every artifact has a key `<job-name>-<what>`, so the Artifacts page keeps one history per job.
Nothing here shows storage options, only URLs (which never hold credentials: the config refuses
secrets). Failing to publish an artifact is logged and never fails the run.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext

from splitstage.config.job import SplitstageConfig
from splitstage.flows.loss_plot import loss_curve_png, png_data_uri
from splitstage.splitter.report import plan_rows
from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.memory.budget import MemoryBudgetError
from splitstage.tasks.memory.fit import choose_fit
from splitstage.tasks.memory.memory_plan import MemoryPlan, estimate_memory
from splitstage.tasks.stage1.preprocess import PreprocessReport
from splitstage.tasks.stage2.outputs import open_output


def artifact_key(config: SplitstageConfig, what: str) -> str:
    """`<job-name>-<what>` in the alphabet Prefect allows for keys (a-z, 0-9, dashes)."""
    slug = re.sub(r"[^a-z0-9]+", "-", f"{config.job.name}-{what}".lower()).strip("-")
    return slug or what


def is_top_level_run() -> bool:
    """True in a flow run that is not a subflow (it then publishes the plan itself)."""
    context = FlowRunContext.get()
    return bool(context and context.flow_run and not context.flow_run.parent_task_run_id)


def _publish(make, *args, **kwargs) -> None:
    """Create an artifact; a failure is a warning in the run log, not a failed run."""
    try:
        make(*args, **kwargs)
    except Exception as error:  # the dashboard must never break the training job
        get_run_logger().warning(f"could not publish artifact {kwargs.get('key')}: {error}")


def _cell(value: Any) -> str:
    """A markdown table cell: pipes escaped, lists joined."""
    if isinstance(value, list | tuple):
        value = ", ".join(str(v) for v in value) or "(none)"
    return str(value).replace("|", "\\|")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-style markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def publish_plan(plan: JobPlan) -> None:
    """The split plan (one row per unit: stage, reason, models) and the offload plan."""
    config, split = plan.config, plan.split
    _publish(
        create_table_artifact,
        table=plan_rows(split),
        key=artifact_key(config, "split-plan"),
        description=f"Split plan of `{split.pipeline}` for trainable "
        f"{', '.join(split.trainable) or '(none)'}: V1 runs every step, V2 once (cached).",
    )
    _publish(
        create_markdown_artifact,
        markdown=offload_markdown(plan),
        key=artifact_key(config, "offload-plan"),
        description="Models each stage loads and never touches; what the cache holds.",
    )
    publish_memory_plan(plan)


def publish_memory_plan(plan: JobPlan) -> None:
    """Each stage's estimated peak device memory per rank, by part (what `validate` prints),
    and with `train.fit = 'auto'` the levers it would choose and their estimate."""
    try:
        memory = fitted_memory_plan(plan)
    except Exception as error:  # the plan is advice: the run's own checks refuse what matters
        get_run_logger().warning(f"no memory plan for the dashboard: {error}")
        return
    _publish(
        create_markdown_artifact,
        markdown=memory_markdown(memory),
        key=artifact_key(plan.config, "memory-plan"),
        description="Estimated peak device memory per rank of each stage, by part (GiB).",
    )


def fitted_memory_plan(plan: JobPlan) -> MemoryPlan:
    """The memory plan, of the levers `train.fit = 'auto'` chooses when it is on (the config
    itself is left as it is: the run's rank 0 chooses, and a resume re-uses its recorded one)."""
    memory = estimate_memory(plan)
    if plan.config.train.fit != "auto":
        return memory
    try:
        choice, memory = choose_fit(plan, memory)
    except MemoryBudgetError as error:
        memory.notes.append(f"train.fit = 'auto' found nothing that fits: {error}")
        return memory
    memory.fit = choice
    memory.notes.append(
        "train.fit: the run's rank 0 makes this choice before training; a resumed run re-uses "
        "the one its checkpoint records (its log says which)"
    )
    return memory


def memory_markdown(memory: MemoryPlan) -> str:
    """The memory plan's table and what each stage was estimated for, as markdown."""
    lines = memory.lines()
    parts = [
        f"### {lines[0]}",
        markdown_table(["part", "stage 1", "stage 2"], memory.rows()),
        "",
    ]
    return "\n".join(parts + [f"- {line.strip()}" for line in lines[2 + len(memory.rows()) :]])


def offload_markdown(plan: JobPlan) -> str:
    """Offload plan, boundary params and cache key as markdown."""
    split = plan.split
    stages = [
        ("stage 1: preprocess (V2, no_grad)", split.models["stage1"], split.offload["stage1"]),
        ("stage 2: train (V1 + denoiser)", split.models["stage2"], split.offload["stage2"]),
    ]
    boundary = [(f"`{p}`", split.boundary_sources.get(p, "?")) for p in split.boundary_params]
    parts = [
        "### Offload plan",
        markdown_table(["stage", "loads", "never loads"], stages),
        "",
        "### Boundary params (the only things cached)",
        markdown_table(["param", "produced by"], boundary),
        "",
        f"**Cache key:** `{plan.cache_key}`",
    ]
    parts += [f"\n> warning: {w}" for w in split.warnings]
    return "\n".join(parts)


def cache_rows(
    report: PreprocessReport, groups: Mapping[str, int] | None = None
) -> list[dict[str, Any]]:
    """Cache statistics as metric/value rows: samples new/reused/skipped, bytes, throughput,
    and the samples of each group (aspect bucket: samples sharing param dtypes and shapes)."""
    seconds = max(report.seconds, 1e-9)
    buckets = [{"metric": f"bucket {label}", "value": n} for label, n in (groups or {}).items()]
    return [
        {"metric": "samples in data set", "value": report.samples},
        {"metric": "new (computed now)", "value": report.computed},
        {"metric": "reused from cache", "value": report.reused},
        {"metric": "skipped (bad rows)", "value": report.skipped},
        {"metric": "duplicates (same content)", "value": report.duplicates},
        {"metric": "bytes written", "value": report.bytes_written},
        {"metric": "shard files written", "value": report.shards_written},
        {"metric": "workers (shards)", "value": report.workers},
        {"metric": "seconds", "value": round(report.seconds, 2)},
        {"metric": "computed samples/s", "value": round(report.computed / seconds, 2)},
        {"metric": "write MB/s", "value": round(report.bytes_written / 1e6 / seconds, 3)},
        {"metric": "cache", "value": report.cache_url},
    ] + buckets


def cache_groups(store: CacheStore) -> dict[str, int]:
    """Committed samples per group label, from the cache index of the run's store ({} if it
    cannot be read: the dashboard must not fail a run)."""
    try:
        return store.stats().groups
    except Exception as error:
        get_run_logger().warning(f"could not count the cache's buckets: {error}")
        return {}


def publish_cache_stats(
    config: SplitstageConfig, report: PreprocessReport, groups: Mapping[str, int]
) -> None:
    """The cache statistics table of one preprocessing run (`groups`: `cache_groups`)."""
    _publish(
        create_table_artifact,
        table=cache_rows(report, groups),
        key=artifact_key(config, "cache-stats"),
        description=f"Stage-1 cache `{report.cache_key}`: {report.computed} new, "
        f"{report.reused} reused, {report.skipped} skipped.",
    )


def publish_loss_curve(
    config: SplitstageConfig, losses: Sequence[float], grad_norms: Sequence[float] = ()
) -> None:
    """The loss (and pre-clip gradient norm) per update as a PNG embedded in markdown (a data:
    URI: no file server needed)."""
    if not losses:
        markdown = "No updates ran, so there is no loss curve (the run resumed at its end?)."
    else:
        title = f"{config.job.name}: loss per update"
        png = loss_curve_png(losses, title, grad_norms)
        markdown = (
            f"![loss curve]({png_data_uri(png)})\n\n"
            f"{len(losses)} updates; first loss {losses[0]:.5f}, final loss {losses[-1]:.5f}, "
            f"min {min(losses):.5f}."
        )
        if grad_norms:
            clip = config.train.max_grad_norm
            clipped = f"; clipped to {clip:g}" if clip else ""
            markdown += (
                f" Gradient norm: final {grad_norms[-1]:.4g}, max {max(grad_norms):.4g}{clipped}."
            )
    _publish(
        create_markdown_artifact,
        markdown=markdown,
        key=artifact_key(config, "loss-curve"),
        description="Training loss per update (mean over ranks) and gradient norm.",
    )


def publish_samples(config: SplitstageConfig, update: int, url: str) -> None:
    """A validation grid as an image artifact (embedded PNG), one history per job."""
    try:
        fs, root = open_output(config, url)
        markdown = (
            f"![samples at update {update}]({png_data_uri(fs.cat_file(root))})\n\n"
            f"Validation samples after update {update} (`{url}`); prompts: "
            + "; ".join(config.validation.prompts)
        )
    except Exception as error:  # a grid that cannot be read must not fail the run
        get_run_logger().warning(f"could not read the validation grid {url}: {error}")
        return
    _publish(
        create_markdown_artifact,
        markdown=markdown,
        key=artifact_key(config, "samples"),
        description=f"Validation samples after update {update}.",
    )


def publish_summary(config: SplitstageConfig, summary: Mapping[str, Any]) -> None:
    """The run summary: time per stage, loss, cache, and where the weights are."""
    _publish(
        create_markdown_artifact,
        markdown=summary_markdown(summary),
        key=artifact_key(config, "summary"),
        description=f"Outputs of job {config.job.name}.",
    )


def summary_markdown(summary: Mapping[str, Any]) -> str:
    """Markdown of a split-training summary (the dict `flows.split_training.summarize` makes)."""
    stage_rows = [(name, f"{seconds:.1f}") for name, seconds in summary["seconds"].items()]
    weights = "\n".join(f"- `{name}`: `{url}`" for name, url in summary["weights"].items())
    loss = summary.get("final_loss")
    parts = [
        f"## {summary['job']}: split training finished",
        f"**Output:** `{summary['output_url']}`\n\n{weights}",
        f"**Latest pointer:** `{summary['latest']}`" if summary.get("latest") else "",
        markdown_table(["stage", "seconds"], stage_rows),
        f"**Final loss:** {loss:.5f} after {summary['updates']} updates"
        if loss is not None
        else "**Final loss:** n/a (no updates ran)",
        f"**Cache:** `{summary['cache_url']}`: {summary['samples_new']} new, "
        f"{summary['samples_reused']} reused, {summary['samples_skipped']} skipped",
    ]
    if summary.get("warm_start_from"):
        parts.append(f"**Warm start from:** `{summary['warm_start_from']}`")
    return "\n\n".join(part for part in parts if part)


class Progress:
    """A progress artifact created once and updated at most every `interval` seconds.

    With `log_as`, every 10% step is also a run-log line `<log_as>: done/total (p%)`.
    """

    def __init__(
        self, key: str, description: str, interval: float = 1.0, log_as: str | None = None
    ) -> None:
        self.interval = interval
        self.log_as = log_as
        self._logger = get_run_logger()
        self._lock = threading.Lock()
        self._last = 0.0
        self._percent = 0.0
        self._logged_step = 0
        self._id = None
        try:
            self._id = create_progress_artifact(0.0, key=key, description=description)
        except Exception as error:  # no dashboard progress is no reason to stop
            self._logger.warning(f"could not create progress artifact {key}: {error}")

    @property
    def percent(self) -> float:
        """The last value set, 0..100."""
        return self._percent

    def set(self, done: float, total: float, force: bool = False) -> None:
        """Record `done` of `total`; publish when the interval has passed (or `force`)."""
        percent = 100.0 if total <= 0 else max(0.0, min(100.0, 100.0 * done / total))
        with self._lock:
            self._percent = percent
            step = int(percent // 10)
            if self.log_as and step > self._logged_step:
                self._logged_step = step
                self._logger.info(f"{self.log_as}: {done:g}/{total:g} ({percent:.0f}%)")
            now = time.monotonic()
            if self._id is None or not (force or now - self._last >= self.interval):
                return
            self._last = now
        with contextlib.suppress(Exception):  # a missed tick is harmless; the next catches up
            update_progress_artifact(self._id, percent)

    def finish(self) -> None:
        """Publish 100%."""
        self.set(1, 1, force=True)
