"""The deployments on a real stack (infra/stack.py): a Prefect server, process workers, S3 (moto).

One module-scoped stack: register deployments/prefect.yaml, run `split-training/local` with the
CLI (`--watch`) on tiny data with the cache in S3 and the shards fanned out to `preprocess/gpu`,
check the run and its artifacts through the API, screenshot its page with headless Chromium, then
cancel a second run mid-training and check the torchrun process tree is gone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CANARY_SECRET = "canary-deploy-secret-9d1e"
BUCKET = "splitstage-deploy"
JOB = "digits-deploy"


def stack_module():
    """infra/stack.py (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("splitstage_stack", ROOT / "infra" / "stack.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_endpoint):
    """Server, pools, deployments and two workers; everything is stopped afterwards."""
    stack_mod = stack_module()
    # moto checks no signatures: a distinctive secret shows whether one leaks into the dashboard.
    stack = stack_mod.Stack(
        tmp_path_factory.mktemp("stack"),
        worker_query_seconds=1,
        extra_env={"AWS_SECRET_ACCESS_KEY": CANARY_SECRET},
    )
    stack.up(inputs=False)
    stack_id = stack.state.stack_id
    try:
        yield stack
    finally:
        stack.down()
        left = [p for p in psutil.process_iter() if tagged(p, stack_id)]
        assert not left, f"left running after down: {[p.cmdline() for p in left]}"


def tagged(proc: psutil.Process, stack_id: str) -> bool:
    """True for a live process started (transitively) by this stack."""
    try:
        return proc.environ().get("SPLITSTAGE_STACK_ID") == stack_id and proc.is_running()
    except psutil.Error:
        return False


def command(proc: psutil.Process) -> str:
    """A process's command line ('' once it is gone)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def client(stack):
    """A sync API client for the stack's server."""
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(stack.state.api_url)


def run_deployment_cli(stack, name: str, params: dict, *, watch: bool) -> tuple[str, str]:
    """`prefect deployment run NAME --params ... [--watch]`; returns (flow run id, output)."""
    args = [sys.executable, "-m", "prefect", "deployment", "run", name, "--params", "-"]
    if watch:
        args += ["--watch", "--watch-interval", "2", "--watch-timeout", "400"]
    done = subprocess.run(
        args,
        input=json.dumps(params),
        env=stack.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=450,
    )
    match = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
    assert match, f"no flow run id in the output:\n{done.stdout}\n{done.stderr}"
    return match[1], done.stdout + done.stderr


@pytest.fixture(scope="module")
def tiny_params(tmp_path_factory, demo_weights, s3_endpoint):
    """A tiny job: 12 digits, tiny text encoder, cache in the S3 test bucket, 2 updates."""
    import s3fs

    from splitstage.data.digits import write_digits_dataset

    root = tmp_path_factory.mktemp("deploy-job")
    write_digits_dataset(root / "data", limit=12)
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).mkdir(BUCKET)
    config = {
        "job": {"name": JOB},
        "models": {
            "text_encoder": {"builder": "tiny"},
            "vae": {"weights": str(demo_weights["vae"])},
            "dit": {"weights": str(demo_weights["dit"])},
        },
        "trainable": {"full": ["dit"]},
        "data": {"base_path": str(root / "data")},
        "cache": {
            "url": f"s3://{BUCKET}/cache",
            "shard_samples": 8,
            "storage_options": {"endpoint_url": s3_endpoint},
        },
        "preprocess": {"batch_size": 8, "device": "cpu"},
        "train": {"batch_size": 4, "max_steps": 2, "log_every": 1},
        "output": {"url": str(root / "output")},
    }
    return {"config": config, "fan_out": "deployment", "shards": 2}


@pytest.fixture(scope="module")
def finished_run(stack, tiny_params):
    """The id of a completed `split-training/local` run (watched with the CLI)."""
    flow_run_id, output = run_deployment_cli(stack, "split-training/local", tiny_params, watch=True)
    assert "Completed" in output, output[-3000:]
    return flow_run_id


def test_local_deployment_runs_end_to_end_with_artifacts(stack, finished_run):
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterName,
        LogFilter,
        LogFilterFlowRunId,
    )

    with client(stack) as api:
        run = api.read_flow_run(finished_run)
        assert run.state.is_completed(), run.state
        shards = api.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=[f"{JOB}-shard-0-of-2", f"{JOB}-shard-1-of-2"])
            )
        )
        assert sorted(s.state.type.value for s in shards) == ["COMPLETED", "COMPLETED"]
        assert {s.work_pool_name for s in shards} == {"splitstage-gpu"}
        artifacts = api.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=JOB))
        )
        children = api.read_flow_runs(limit=50)
        logs = api.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in children]))
        )
        texts = [json.dumps(r.parameters, default=str) for r in children]
    by_key = {a.key: a for a in artifacts}
    for what in ("split-plan", "offload-plan", "cache-stats", "loss-curve", "summary"):
        assert f"{JOB}-{what}" in by_key, what
    stats = {r["metric"]: r["value"] for r in json.loads(by_key[f"{JOB}-cache-stats"].data)}
    assert stats["new (computed now)"] == 12 and stats["cache"].startswith(f"s3://{BUCKET}/")
    assert by_key[f"{JOB}-train-progress"].data == 100.0
    assert "data:image/png;base64," in by_key[f"{JOB}-loss-curve"].data
    assert "latest.json" in by_key[f"{JOB}-summary"].data
    assert any("update 2/2" in log.message for log in logs)  # torchrun output in the run log
    texts += [log.message for log in logs] + [f"{a.description} {a.data}" for a in artifacts]
    assert not [t for t in texts if CANARY_SECRET in t]


def chromium() -> str | None:
    """The headless browser, if installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def test_run_page_renders_in_headless_chromium(stack, finished_run, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("chromium is not installed: `apt-get install -y chromium` (CI must install it)")
    from PIL import Image

    shot = tmp_path / "flow-run.png"
    url = f"{stack.state.ui_url}/runs/flow-run/{finished_run}"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}",
            "--virtual-time-budget=10000",
            "--window-size=1400,900",
            f"--screenshot={shot}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    image = Image.open(shot).convert("L")
    assert image.size == (1400, 900)
    low, high = image.getextrema()
    assert high - low > 100, "blank screenshot"
    assert len(image.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 20
    if target := os.environ.get("SPLITSTAGE_SCREENSHOT"):
        shutil.copy(shot, target)


def test_cancelling_a_deployment_run_ends_its_torchrun_tree(stack, tiny_params, finished_run):
    params = json.loads(json.dumps(tiny_params))
    params["fan_out"] = "local"  # the cache is warm: nothing to preprocess
    params["config"]["train"].update(max_steps=100_000, checkpoint_every=1_000_000)
    flow_run_id, _ = run_deployment_cli(stack, "split-training/local", params, watch=False)
    stack_id = stack.state.stack_id

    def training() -> list[psutil.Process]:
        return [
            p
            for p in psutil.process_iter()
            if tagged(p, stack_id)
            and re.search(r"tasks\.stage2\.worker|torch\.distributed\.run", command(p))
        ]

    deadline = time.monotonic() + 180
    while not any("stage2.worker" in command(p) for p in training()):
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.5)
    tree = training()
    stack.prefect("flow-run", "cancel", flow_run_id)
    deadline = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree):
        assert time.monotonic() < deadline, "torchrun processes outlived the cancel"
        time.sleep(0.2)
    deadline = time.monotonic() + 90
    with client(stack) as api:
        while not api.read_flow_run(flow_run_id).state.is_cancelled():
            assert time.monotonic() < deadline, api.read_flow_run(flow_run_id).state
            time.sleep(1)
