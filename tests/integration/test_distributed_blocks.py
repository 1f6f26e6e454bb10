"""Stage-2 building blocks under real torchrun (gloo, CPU): parallelize, weights, DCP, launcher.

Each torchrun launch costs seconds here, so one worker launch serves many tests (module fixtures);
the workers live in tests/integration/workers/. Layouts on 2 ranks: ddp 2, fsdp 2, tp 2 and
fsdp+tp on a 2-D 1x2 mesh; one 4-rank launch covers fsdp+tp on a 2x2 mesh.
Run: .venv/bin/pytest -m slow tests/integration/test_distributed_blocks.py
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from splitstage.process.liveness import is_alive
from splitstage.process.torchrun import (
    TorchrunError,
    TorchrunSpec,
    build_command,
    free_port,
    run_torchrun,
)
from splitstage.tasks.stage2.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from splitstage.tasks.stage2.distributed import build_mesh
from splitstage.tasks.stage2.parallelize import parallelize, resolve_tp_plan
from tests.integration.workers.tiny import TP_PLAN, Tiny, add_lora

WORKERS = Path(__file__).parent / "workers"
ROOT = Path(__file__).resolve().parents[2]
ENV = {"SPLITSTAGE_DEVICE": "cpu", "PYTHONPATH": f"{ROOT}{os.pathsep}{WORKERS}"}
MODES_2 = ("ddp", "fsdp", "tp", "fsdp+tp")


def launch(script: str, args, nproc: int = 2, timeout: float = 240, **kw):
    """Run a worker under torchrun on CPU/gloo and return its TorchrunResult."""
    spec = TorchrunSpec(
        str(WORKERS / script), [str(a) for a in args], nproc_per_node=nproc, env=ENV
    )
    return run_torchrun(spec, timeout=timeout, **kw)


def results_of(out_dir: Path, nproc: int) -> list[dict]:
    """Per-rank check results written by blocks_worker."""
    return [json.loads((out_dir / f"results-rank{r}.json").read_text()) for r in range(nproc)]


def assert_check(results: list[dict], name: str) -> list:
    """The named check passed on every rank; return each rank's detail."""
    for rank, checks in enumerate(results):
        assert name in checks, f"rank {rank} did not run {name}"
        assert checks[name]["ok"], f"rank {rank} {name}:\n{checks[name]['detail']}"
    return [checks[name]["detail"] for checks in results]


# -- fast checks, no processes --------------------------------------------------------------------


def test_build_mesh_names_the_config_fields():
    with pytest.raises(ValueError, match=r"dp=2 x tp=2 = 4 ranks but the job has 2.*parallelism"):
        build_mesh(2, 2, 2)
    with pytest.raises(ValueError, match="train.tp_degree must be a positive integer"):
        build_mesh(2, 0, 0)


def test_parallelize_rejects_unknown_and_inconsistent_modes():
    with pytest.raises(ValueError, match=r"train.parallelism='zero3'.*ddp, fsdp, tp, fsdp\+tp"):
        parallelize(Tiny(), mesh=None, mode="zero3")
    with pytest.raises(ValueError, match="needs a device mesh"):
        parallelize(Tiny(), mesh=None, mode="fsdp")
    assert isinstance(parallelize(Tiny(), mesh=None, mode="none"), Tiny)


def test_tp_plan_resolves_through_peft_and_names_unmatched_patterns():
    model = add_lora(Tiny())
    plan = resolve_tp_plan(model, TP_PLAN)
    prefix = "base_model.model.blocks.0"
    assert type(plan[f"{prefix}.fc1.base_layer"]).__name__ == "ColwiseParallel"
    assert f"{prefix}.fc1.lora_B.default" in plan and f"{prefix}.fc1.lora_A.default" not in plan
    assert f"{prefix}.fc2.lora_A.default" in plan and f"{prefix}.fc2.lora_B.default" not in plan
    with pytest.raises(ValueError, match="'blocks.*.qkv' matches no module"):
        resolve_tp_plan(model, {"blocks.*.qkv": "colwise"})


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A Tiny model and AdamW after one step (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoint_single_process_roundtrip_keep_last_and_incomplete(tmp_path):
    model, opt = _trained()
    extra = {
        "step": 3,
        "sched": {"last_epoch": 3},
        "pos": torch.arange(4),
        "t": (1, (2, 3)),
        7: "x",
    }
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), step, model, opt, extra, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000002", "step-00000003"]
    (tmp_path / "step-00000009").mkdir()  # an unfinished save: no COMPLETE marker
    (tmp_path / "step-00000009" / ".metadata").write_bytes(b"")
    assert latest_checkpoint(f"file://{tmp_path}") == 3
    assert not (tmp_path / "step-00000009").exists()
    fresh, fresh_opt = _trained(seed=1)
    got = load_checkpoint(str(tmp_path), 3, fresh, fresh_opt)
    assert got["step"] == 3 and got["t"] == (1, (2, 3)) and got[7] == "x"
    assert torch.equal(got["pos"], torch.arange(4))
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(TypeError, match=r"extra_state\['f'\] is a function.*no pickle"):
        save_checkpoint(str(tmp_path), 4, model, opt, {"f": lambda: 0})


def test_checkpoint_with_missing_file_is_a_named_error(tmp_path):
    model, opt = _trained()
    save_checkpoint(str(tmp_path), 5, model, opt, {"step": 5})
    (tmp_path / "step-00000005" / "__0_0.distcp").unlink()
    assert latest_checkpoint(str(tmp_path)) == 5  # complete once: never silently skipped
    with pytest.raises(CheckpointError, match=r"step-00000005 is damaged: missing __0_0\.distcp"):
        load_checkpoint(str(tmp_path), 5, model, opt)
    with pytest.raises(CheckpointError, match="step-00000006 is unfinished or missing"):
        load_checkpoint(str(tmp_path), 6, model, opt)


def test_build_command_single_and_multi_node():
    single = build_command(TorchrunSpec("pkg.train", ["--x", 1], nproc_per_node=2))
    assert "--standalone" in single and single[-4:] == ["-m", "pkg.train", "--x", "1"]
    multi = TorchrunSpec("w.py", nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400")
    cmd = build_command(multi, log_dir="/tmp/logs")
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=10.0.0.1:29400" in cmd
    assert "--nnodes=2" in cmd and "--tee=3" in cmd and cmd[-1] == "w.py"
    with pytest.raises(ValueError, match="needs rdzv_endpoint"):
        build_command(TorchrunSpec("w.py", nnodes=2))


SINGLE_PROCESS = """
import torch
from splitstage.tasks.stage2.checkpoint import load_checkpoint, save_checkpoint
from splitstage.tasks.stage2.distributed import build_mesh, close_distributed, init_distributed
from splitstage.process.liveness import is_alive
from splitstage.tasks.stage2.parallelize import parallelize
from tiny import Tiny
info = init_distributed()
mesh = build_mesh(1, 1, info.world_size)
model = parallelize(Tiny(), mesh=mesh, mode="fsdp")
save_checkpoint(URL, 1, model, None, {"k": 1})
print("RESULT", info.rank, info.world_size, info.backend, info.device.type, mesh.mesh_dim_names,
      load_checkpoint(URL, 1, model, None))
close_distributed()
"""


@pytest.mark.slow
def test_init_distributed_without_torchrun(tmp_path):
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    code = SINGLE_PROCESS.replace("URL", repr(str(tmp_path)))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, **ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "RESULT 0 1 gloo cpu ('dp',) {'k': 1}" in out.stdout


# -- parallelize + materialize_and_load (one 2-rank launch, one 4-rank launch) --------------------


@pytest.fixture(scope="module")
def blocks(tmp_path_factory) -> list[dict]:
    """One 2-rank blocks_worker launch; its per-rank check results."""
    out = tmp_path_factory.mktemp("blocks2")
    launch("blocks_worker.py", [out], nproc=2).raise_for_status()
    return results_of(out, 2)


@pytest.fixture(scope="module")
def blocks_2x2(tmp_path_factory) -> list[dict]:
    """One 4-rank blocks_worker launch (fsdp+tp on a 2x2 mesh)."""
    out = tmp_path_factory.mktemp("blocks4")
    launch("blocks_worker.py", [out], nproc=4).raise_for_status()
    return results_of(out, 4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES_2)
def test_parallelize_same_loss_as_one_process(blocks, mode):
    for detail in assert_check(blocks, f"loss/{mode}"):
        assert detail["max_param_diff"] <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES_2)
def test_lora_trains_only_adapters_with_same_loss(blocks, mode):
    assert_check(blocks, f"lora/{mode}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES_2)
@pytest.mark.parametrize("strategy", ["slices", "broadcast"])
@pytest.mark.parametrize("fmt", ["w.safetensors", "w.pt"])
def test_loaded_weights_equal_the_file(blocks, mode, strategy, fmt):
    assert_check(blocks, f"load/{mode}/{strategy}/{fmt}")


@pytest.mark.slow
def test_load_extras_cast_buffers_report(blocks):
    assert_check(blocks, "load/cast-bf16")
    assert assert_check(blocks, "load/buffers") == [True, True]
    reports = assert_check(blocks, "load/report")
    assert all(r["loaded"] == 16 and r["strategy"] == "slices" for r in reports)


@pytest.mark.slow
def test_bad_weight_files_give_named_errors(blocks):
    for msg in assert_check(blocks, "error/missing-file"):
        assert "nope.safetensors does not exist" in msg
    for msg in assert_check(blocks, "error/prefix"):
        assert "set key_prefix='model.diffusion_model.'" in msg
    assert_check(blocks, "load/with-prefix")
    for name in ("error/keys", "error/keys-broadcast"):
        for msg in assert_check(blocks, name):
            assert "missing from the file: head.bias" in msg
            assert "unexpected keys in the file: extra.weight" in msg
    for msg in assert_check(blocks, "error/shape"):
        assert "'head.weight' has shape (2, 7) in the file but (1, 7) in the model" in msg
    for msg in assert_check(blocks, "error/buffers"):
        assert "phase" in msg and "buffers_init" in msg


@pytest.mark.slow
def test_a_rank_failing_to_save_fails_every_rank(blocks):
    rank0, rank1 = assert_check(blocks, "error/save-one-rank")
    assert "rank 1: disk full (simulated)" in rank0  # the other rank's cause, not only a count
    assert "disk full (simulated)" in rank1


@pytest.mark.slow
def test_fsdp_tp_on_a_2x2_mesh(blocks_2x2):
    for strategy in ("slices", "broadcast"):
        for fmt in ("w.safetensors", "w.pt"):
            assert_check(blocks_2x2, f"load/fsdp+tp/{strategy}/{fmt}")
    assert_check(blocks_2x2, "loss/fsdp+tp")
    assert_check(blocks_2x2, "lora/fsdp+tp")


# -- checkpoints: SIGKILL + resume, reshard, S3 ---------------------------------------------------


def _losses(path: Path) -> dict[str, float]:
    """{step: loss} written by ckpt_worker."""
    return json.loads(path.read_text())


def _params(path: Path) -> dict[str, torch.Tensor]:
    """Full params written by ckpt_worker."""
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.fixture(scope="module")
def ckpt_runs(tmp_path_factory) -> Path:
    """A: 6 steps uninterrupted; B: rank 1 SIGKILLed at step 5; C: B resumed; D: A on 1 rank."""
    out = tmp_path_factory.mktemp("ckpt")
    common = ["--out", out, "--steps", 6, "--save-every", 2, "--keep-last", 2]
    launch("ckpt_worker.py", ["--url", out / "A", "--tag", "A", *common]).raise_for_status()
    crashed = launch("ckpt_worker.py", ["--url", out / "B", "--tag", "B", "--crash-at", 5, *common])
    (out / "crash.json").write_text(
        json.dumps({"rc": crashed.returncode, "rank": crashed.failed_rank, "err": crashed.error})
    )
    launch(
        "ckpt_worker.py", ["--url", out / "B", "--tag", "C", "--resume", *common]
    ).raise_for_status()
    launch(
        "ckpt_worker.py",
        [
            "--url",
            out / "A",
            "--tag",
            "D",
            "--resume",
            "--check-params",
            out / "saved-A-6.safetensors",
        ]
        + ["--out", out, "--steps", 7],
        nproc=1,
    ).raise_for_status()
    return out


@pytest.mark.slow
def test_resume_after_sigkill_is_bitwise_identical(ckpt_runs):
    crash = json.loads((ckpt_runs / "crash.json").read_text())
    assert crash["rc"] != 0 and crash["rank"] == 1 and "SIGKILL" in crash["err"]
    full = _losses(ckpt_runs / "losses-A.json")
    before = _losses(ckpt_runs / "losses-B.json")
    after = _losses(ckpt_runs / "losses-C.json")
    assert list(before) == ["1", "2", "3", "4"] and list(after) == ["5", "6"]
    assert {**before, **after} == full  # exact float equality
    a, c = _params(ckpt_runs / "final-A.safetensors"), _params(ckpt_runs / "final-C.safetensors")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    assert sorted(os.listdir(ckpt_runs / "B")) == ["step-00000004", "step-00000006"]


@pytest.mark.slow
def test_reshard_two_ranks_to_one(ckpt_runs):
    check = json.loads((ckpt_runs / "check-D.json").read_text())
    assert check["max_diff"] == 0.0 and len(check["keys"]) == 16
    assert list(_losses(ckpt_runs / "losses-D.json")) == ["7"]


@pytest.mark.slow
def test_lora_only_checkpoint_on_s3(s3_bucket, tmp_path):
    import s3fs
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url, options = s3_bucket
    ckpt = f"{url}/ckpt"
    args = ["--url", ckpt, "--out", tmp_path, "--tag", "S3", "--steps", 4, "--save-every", 2]
    args += [
        "--keep-last",
        1,
        "--lora",
        "--verify-reload",
        "--storage-options",
        json.dumps(options),
    ]
    launch("ckpt_worker.py", args).raise_for_status()
    reload = json.loads((tmp_path / "reload-S3.json").read_text())
    assert reload == {"step": 4, "extra_step": 4, "params_equal": True, "optim_equal": True}
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(**options)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(ckpt.removeprefix("s3://")))
    assert names == ["step-00000004"]  # keep_last=1 pruned step 2 on S3 too
    files = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{ckpt.removeprefix('s3://')}/step-00000004")}
    assert {"COMPLETE", ".metadata", "extra.safetensors", "rng-rank00001.safetensors"} <= files
    keys = FsspecReader(f"{ckpt}/step-00000004", **options).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys
    assert latest_checkpoint(ckpt, storage_options=options) == 4


# -- launcher --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fail", "fail-record"])
def test_failing_rank_error_is_returned(mode):
    result = launch("launch_worker.py", [mode], timeout=60)
    assert not result.ok and result.returncode != 0
    assert result.failed_rank == 1 and result.failed_local_rank == 1
    assert "ValueError: boom-rank1" in result.error
    assert any(line.startswith("[default0]:rank 0 starting") for line in result.output_tail)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "raise-record"])
def test_a_one_process_job_runs_without_the_agent_and_fails_as_under_torchrun(mode):
    """One process on one node: the rank is started directly (no torchrun agent in the tree);
    its lines, its per-rank logs and the failure report read as torchrun's would."""
    spec = TorchrunSpec(str(WORKERS / "launch_worker.py"), [mode], nproc_per_node=1, env=ENV)
    assert not spec.uses_agent
    assert TorchrunSpec("w.py", nproc_per_node=1, max_restarts=1).uses_agent
    result = run_torchrun(spec, timeout=60)
    assert "splitstage.process.torchrun_agent" not in " ".join(result.command)
    assert not result.ok and result.returncode == 1
    assert result.failed_rank == 0 and result.failed_local_rank == 0
    assert "ValueError: boom-rank0" in result.error
    assert "[default0]:rank 0 of 1 starting" in result.output_tail
    assert str(result.log_dir) in str(TorchrunError(result))
    assert str(TorchrunError(result)).startswith("the training process failed (exit 1): rank 0")
    rank_logs = Path(result.log_dir, "local", "attempt_0", "0")
    assert "rank 0 of 1 starting" in (rank_logs / "stdout.log").read_text()
    assert "boom-rank0" in (rank_logs / "stderr.log").read_text()
    assert (rank_logs / "error.json").is_file() == (mode == "raise-record")


@pytest.mark.slow
def test_a_one_process_job_joins_a_gloo_group_and_timeout_stops_it():
    """A script that opens its own env:// group runs as under torchrun; a timeout leaves no
    process of the one-rank job alive."""
    done = run_torchrun(
        TorchrunSpec(str(WORKERS / "launch_worker.py"), ["allreduce"], env=ENV), timeout=60
    )
    assert done.ok and "[default0]:WORLD 1 RANK 0 SUM 0" in done.output_tail, done.output_tail
    pids: list[int] = []
    spec = TorchrunSpec(str(WORKERS / "launch_worker.py"), ["sleep"], env=ENV)
    result = run_torchrun(spec, timeout=6, on_line=lambda s: _pids_from(s, pids))
    assert result.timed_out and len(pids) == 2
    deadline = time.monotonic() + 5
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if is_alive(p)], "processes left alive"


def _pids_from(line: str, pids: list[int]) -> None:
    """Collect the pids a sleep worker prints."""
    if "PIDS" in line:
        pids.extend(int(p) for p in line.split("PIDS", 1)[1].split())


def _assert_all_gone(pids: list[int]) -> None:
    """Every worker and grandchild has exited (zombies count as gone)."""
    assert len(pids) == 4, pids  # 2 workers + 1 grandchild each
    deadline = time.monotonic() + 5
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if is_alive(p)], "processes left alive"


@pytest.mark.slow
def test_timeout_leaves_no_process_alive():
    pids: list[int] = []
    result = launch("launch_worker.py", ["sleep"], timeout=6, on_line=lambda s: _pids_from(s, pids))
    assert result.timed_out and not result.ok
    _assert_all_gone(pids)


@pytest.mark.slow
def test_cancel_event_and_keyboard_interrupt_leave_no_process_alive():
    pids: list[int] = []
    cancel = threading.Event()

    def on_line(line: str) -> None:
        _pids_from(line, pids)
        if len(pids) == 4:
            cancel.set()

    result = launch("launch_worker.py", ["sleep"], timeout=60, on_line=on_line, cancel=cancel)
    assert result.cancelled
    _assert_all_gone(pids)

    pids2: list[int] = []

    def interrupt(line: str) -> None:
        _pids_from(line, pids2)
        if len(pids2) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch("launch_worker.py", ["sleep"], timeout=60, on_line=interrupt)
    _assert_all_gone(pids2)


@pytest.mark.slow
def test_two_torchrun_agents_form_a_two_node_job():
    port = free_port()
    results = {}

    def agent(node: int) -> None:
        spec = TorchrunSpec(
            str(WORKERS / "launch_worker.py"),
            ["allreduce"],
            nnodes=2,
            nproc_per_node=1,
            node_rank=node,
            rdzv_endpoint=f"127.0.0.1:{port}",
            rdzv_id="two-node-test",
            env=ENV,
        )
        results[node] = run_torchrun(spec, timeout=90)

    threads = [threading.Thread(target=agent, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = [line for r in results.values() for line in r.output_tail if "WORLD" in line]
    assert all(r.ok for r in results.values()), [r.error for r in results.values()]
    assert sorted(line.split("]:", 1)[1] for line in lines) == [
        "WORLD 2 RANK 0 SUM 1",
        "WORLD 2 RANK 1 SUM 1",
    ]
