"""The Prefect flows on a test server: end to end, incremental reruns, S3 cache, cancellation."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import psutil
import pytest

from splitstage.config.job import ConfigError, SplitstageConfig
from splitstage.data.dataset import DataError
from splitstage.flows.artifacts import artifact_key, summary_markdown
from splitstage.flows.loss_plot import loss_curve_png
from splitstage.flows.multinode import apply_node_env, torchrun_command
from splitstage.flows.task_wrappers import is_transient_io_error, retry_on_io
from splitstage.flows.versioned_outputs import export_prefix, version_for
from splitstage.storage.files import StorageCredentialsError, StorageUnreachableError

CANARY_KEY_ID = "AKIACANARYKEYID0000"
CANARY_SECRET = "canary-secret-must-never-be-shown-7f3a"
PLAN_ARTIFACTS = ("split-plan", "offload-plan", "memory-plan")
RUN_ARTIFACTS = (
    "cache-stats",
    "index-progress",  # both runs hash images: 12, then the 3 new ones
    "preprocess-progress",
    "train-progress",
    "loss-curve",
    "summary",
)


# ---- plain helpers (no server) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionResetError("reset"), True),
        (TimeoutError("slow"), True),
        (StorageUnreachableError("endpoint down"), True),
        (OSError("EIO"), True),
        (FileNotFoundError("gone"), False),
        (StorageCredentialsError("bad key"), False),
        (ConfigError("bad field"), False),
        (DataError("bad row"), False),
        (RuntimeError("bug"), False),
    ],
)
def test_retries_only_on_transient_io_errors(error, transient):
    assert is_transient_io_error(error) is transient


def test_retry_condition_reads_the_failed_states_exception():
    from prefect.states import Failed

    assert retry_on_io(None, None, Failed(data=ConnectionResetError("reset")))
    assert not retry_on_io(None, None, Failed(data=ConfigError("models.vae.weights: missing")))


def test_loss_curve_is_a_png_with_the_gradient_norm_below_when_given():
    losses = [1.0 / (i + 1) for i in range(40)]
    png = loss_curve_png(losses)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) < 100_000
    both = loss_curve_png(losses, grad_norms=[0.5 + 0.01 * i for i in range(40)])
    assert both.startswith(b"\x89PNG\r\n\x1a\n") and len(both) < 150_000
    height = lambda png: int.from_bytes(png[20:24], "big")  # noqa: E731 - the IHDR height
    assert height(both) > height(png)


def test_artifact_keys_and_versions_are_well_formed():
    config = SplitstageConfig.model_validate({"job": {"name": "My_Job.v2"}})
    assert artifact_key(config, "split-plan") == "my-job-v2-split-plan"

    class Run:
        id = "1a2b3c4d-0000-0000-0000-000000000000"
        created = None

    version = version_for(Run())
    assert version.endswith("-1a2b3c4d") and version[8] == "T" and version[15] == "Z"


def test_export_prefix_follows_remove_prefix_in_ckpt():
    config = SplitstageConfig.model_validate({"output": {"remove_prefix_in_ckpt": "pipe."}})
    assert export_prefix(config, "dit") == "dit."
    assert export_prefix(SplitstageConfig(), "dit") == "pipe.dit."


def test_node_env_sets_rendezvous_and_rank():
    env = {
        "SPLITSTAGE_NNODES": "3",
        "JOB_COMPLETION_INDEX": "2",
        "SPLITSTAGE_RDZV_ENDPOINT": "job-0.splitstage-rdzv:29500",
    }
    config, rank = apply_node_env(SplitstageConfig(), env)
    assert (rank, config.train.nnodes, config.train.rdzv_endpoint) == (
        2,
        3,
        "job-0.splitstage-rdzv:29500",
    )
    command = " ".join(torchrun_command(config, rank))
    assert (
        "--rdzv-backend=c10d" in command
        and "--rdzv-endpoint=job-0.splitstage-rdzv:29500" in command
    )
    with pytest.raises(ConfigError, match="SPLITSTAGE_NNODES"):
        apply_node_env(SplitstageConfig(), {**env, "JOB_COMPLETION_INDEX": "3"})


def test_summary_markdown_names_outputs_and_stage_times():
    text = summary_markdown(
        {
            "job": "j",
            "output_url": "runs/out/j/v1",
            "weights": {"dit": "runs/out/j/v1/dit.safetensors"},
            "latest": "runs/out/j/latest.json",
            "seconds": {"plan": 1.0, "preprocess": 2.0, "train": 3.0, "total": 6.0},
            "final_loss": 0.5,
            "updates": 2,
            "cache_url": "runs/cache/k",
            "samples_new": 1,
            "samples_reused": 2,
            "samples_skipped": 0,
        }
    )
    assert "runs/out/j/v1/dit.safetensors" in text and "| train | 3.0 |" in text


# ---- flows on a Prefect test server --------------------------------------------------------------


def artifacts_by_key(job: str) -> dict[str, list]:
    """Every version of this job's artifacts, oldest first, grouped by key."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=job)), limit=200
        )
    grouped: dict[str, list] = {}
    for artifact in sorted(found, key=lambda a: a.created):
        grouped.setdefault(artifact.key, []).append(artifact)
    return grouped


def run_texts(flow_run_ids) -> list[str]:
    """Parameters, log messages and artifact contents of these flow runs and their subflows."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    texts = []
    with get_client(sync_client=True) as client:
        ids = list(flow_run_ids)
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=ids))
        )
        ids += [run.id for run in children]
        for run_id in ids:
            texts.append(json.dumps(client.read_flow_run(run_id).parameters, default=str))
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)))
        texts += [log.message for log in logs]
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids))
        )
        texts += [f"{a.description} {a.data}" for a in artifacts]
    return texts


@pytest.mark.slow
def test_incremental_rerun_writes_new_version_and_artifacts(prefect_harness, tiny_job, tmp_path):
    from splitstage.data.digits import write_digits_dataset
    from splitstage.flows.split_training import split_training

    job = "digits-incremental"
    config = tiny_job(job, samples=12)
    first = split_training(config)
    assert (first["samples_new"], first["samples_reused"]) == (12, 0)

    write_digits_dataset(tmp_path / "data", limit=15)  # same bytes for the first 12, 3 new
    second = split_training(config, warm_start_from_latest=True)
    assert (second["samples_new"], second["samples_reused"]) == (3, 12)
    assert second["samples"] == 15 and second["cache_key"] == first["cache_key"]

    assert second["version"] != first["version"]
    for run in (first, second):
        assert run["output_url"].endswith(f"{job}/{run['version']}")
        assert Path(run["weights"]["dit"]).is_file() and run["updates"] == 2
    latest = json.loads((tmp_path / "output" / job / "latest.json").read_text())
    assert latest["version"] == second["version"] and latest["weights"] == second["weights"]
    assert second["warm_start_from"] == first["output_url"]
    assert set(second["seconds"]) == {"plan", "preprocess", "train", "total"}

    artifacts = artifacts_by_key(job)
    for what in PLAN_ARTIFACTS + RUN_ARTIFACTS:
        assert len(artifacts.get(f"{job}-{what}", [])) == 2, what
    plan = json.loads(artifacts[f"{job}-split-plan"][-1].data)
    assert {row["unit"]: row["stage"].split()[0] for row in plan}["CaptionDropout"] == "V1"
    stats = json.loads(artifacts[f"{job}-cache-stats"][-1].data)
    assert {r["metric"]: r["value"] for r in stats}["new (computed now)"] == 3
    assert artifacts[f"{job}-train-progress"][-1].data == 100.0
    assert artifacts[f"{job}-preprocess-progress"][-1].data == 100.0
    assert artifacts[f"{job}-index-progress"][-1].data == 100.0
    assert "data:image/png;base64," in artifacts[f"{job}-loss-curve"][-1].data
    assert "Gradient norm: final " in artifacts[f"{job}-loss-curve"][-1].data
    assert second["weights"]["dit"] in artifacts[f"{job}-summary"][-1].data


@pytest.mark.slow
def test_preprocess_flow_on_s3_keeps_credentials_out_of_the_dashboard(
    prefect_harness, tiny_job, s3_bucket, s3_endpoint, monkeypatch
):
    """Two local shards write the cache to S3 (training from S3 runs in test_deployments)."""
    from splitstage.flows.preprocess_flow import preprocess_flow
    from splitstage.storage.files import open_fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CANARY_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CANARY_SECRET)
    url, _ = s3_bucket
    job = "digits-s3"
    config = tiny_job(
        job,
        samples=8,
        cache={"url": f"{url}/cache", "storage_options": {"endpoint_url": s3_endpoint}},
    )
    state = preprocess_flow(config, shards=2, return_state=True)
    report = state.result()
    assert report["cache_url"].startswith("s3://bucket/prefix/cache/")
    assert (report["computed"], report["workers"]) == (8, 2)
    fs, root = open_fs(report["cache_url"], {"endpoint_url": s3_endpoint})
    assert fs.ls(f"{root}/index")
    assert len(artifacts_by_key(job)[f"{job}-split-plan"]) == 1  # top level: it shows the plan
    texts = run_texts([state.state_details.flow_run_id])
    assert any(s3_endpoint in text for text in texts)  # the parameters were searched
    leaks = [t for t in texts if CANARY_SECRET in t or CANARY_KEY_ID in t]
    assert not leaks
    again = preprocess_flow(config, shards=2)  # all cached: the flow's check, no shard runs
    assert (again["computed"], again["reused"], again["workers"]) == (0, 8, 0)
    shard = sorted(fs.ls(f"{root}/shards"))[0]
    data = bytearray(fs.cat_file(shard))
    data[-1] ^= 0xFF  # rewritten after its index entry, same size: found only by its sha256
    fs.pipe_file(shard, bytes(data))
    fixed = preprocess_flow(config, shards=2)
    assert (fixed["workers"], fixed["damaged"], fixed["computed"]) == (2, 1, fixed["repaired"])
    assert fixed["computed"] > 0


@pytest.mark.slow
def test_cancelling_training_ends_the_torchrun_process_tree(prefect_harness, tiny_job):
    from prefect import get_client
    from prefect.states import Cancelling

    from splitstage.flows.train_flow import train_flow
    from splitstage.tasks.stage1.preprocess import preprocess

    train = {"max_steps": 100_000, "checkpoint_every": 10**6, "nproc_per_node": 2}  # an agent
    config = SplitstageConfig.model_validate(tiny_job("digits-cancel", samples=8, train=train))
    preprocess(config, progress=False)
    outcome: dict = {}
    runner = threading.Thread(
        target=lambda: outcome.update(state=train_flow(config, return_state=True)), daemon=True
    )
    runner.start()
    flow_run_id = wait_for_training_processes(timeout=90)
    tree = training_processes()
    assert any("splitstage.process.torchrun_agent" in command(p) for p in tree)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
    runner.join(timeout=60)
    assert not runner.is_alive(), "the flow did not stop after the cancel"
    assert outcome["state"].is_cancelled()
    deadline = time.monotonic() + 15
    while any(p.is_running() for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after cancel: {[p.cmdline() for p in alive]}"


def command(proc: psutil.Process) -> str:
    """A process's command line ('' once it is gone)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def training_processes() -> list[psutil.Process]:
    """torchrun agents and training workers started (transitively) by this test process."""
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if any(f"splitstage.tasks.stage2.{m}" in command(p) for m in ("agent", "worker"))
    ]


def wait_for_training_processes(timeout: float):
    """Wait for a training worker under this process; return the running train flow run's id."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any("splitstage.tasks.stage2.worker" in command(p) for p in training_processes()):
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(
                    flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])),
                    flow_run_filter=FlowRunFilter(
                        state=FlowRunFilterState(
                            type=FlowRunFilterStateType(any_=[StateType.RUNNING])
                        )
                    ),
                )
            if runs:
                return runs[0].id
        time.sleep(0.5)
    raise AssertionError("no training worker process started")


def test_validation_grids_are_published_as_image_artifacts(prefect_harness, tiny_job):
    from splitstage.flows.split_training import split_training

    job = "digits-samples"
    prompts = ["a handwritten digit seven", "a handwritten digit one"]
    config = tiny_job(job, samples=8, validation={"prompts": prompts, "steps": 2, "every": 1})
    summary = split_training(config)
    grids = summary["sample_grids"]
    assert sorted(grids) == ["1", "2"] and all(Path(url).is_file() for url in grids.values())
    published = artifacts_by_key(job)[f"{job}-samples"]  # one history per job, one per grid
    assert len(published) == 2
    assert all("](data:image/png;base64," in a.data for a in published)
    assert "update 2" in published[-1].description and prompts[0] in published[-1].data
