"""Stage 2 under real torchrun (gloo, CPU): layouts agree, only stage-2 models load, crash/resume.

Tiny data (40 digits), the tiny text encoder, the demo DiT; one preprocessing run serves all tests.
Run: .venv/bin/pytest -m slow tests/integration/test_train.py
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from splitstage.config.job import ConfigError
from splitstage.process.torchrun import TorchrunError
from splitstage.tasks.launch.launcher import train
from tests.helpers.tiny_job import make_workspace, tiny_config

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu"}
SEED = 3


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A digits subset, demo weights and a filled cache, shared by the module's tests."""
    return make_workspace(tmp_path_factory.mktemp("train"), samples=40, seed=SEED)


def make_config(root: Path, name: str, **train):
    """A tiny job config; `train` overrides [train] fields."""
    return tiny_config(root, name, SEED, **train)


def run(root: Path, name: str, **train):
    """Train a config to the end; return the report."""
    return train_config(root, make_config(root, name, **train))


def train_config(root: Path, config, **kw):
    return train(config, run_root=root / "runs", env=ENV, on_line=lambda line: None, **kw)


def weights(report) -> dict:
    return load_file(report.outputs["dit"])


def test_split_loads_only_dit_and_unsplit_gives_the_same_losses(workspace):
    split = run(workspace, "split-1")
    unsplit = run(workspace, "unsplit-1", mode="unsplit")
    assert split.models_loaded == ["dit"]
    assert unsplit.models_loaded == ["dit", "text_encoder", "vae"]
    assert split.updates == 3 and len(split.losses) == 3
    assert split.losses == unsplit.losses  # same seed: cached V2 outputs are exact
    exported = weights(split)
    assert exported and all(".lora_" in key for key in exported)
    assert all(not key.startswith("pipe.") for key in exported)


def test_tensor_parallel_equals_one_process_and_fsdp_equals_ddp(workspace):
    one = run(workspace, "one")
    tp = run(workspace, "tp-2", nproc_per_node=2, parallelism="tp", tp_degree=2)
    ddp = run(workspace, "ddp-2", nproc_per_node=2)
    fsdp = run(workspace, "fsdp-2", nproc_per_node=2, parallelism="fsdp")
    assert tp.world_size == 2 and tp.parallelism == "tp"
    assert tp.losses == pytest.approx(one.losses, rel=1e-5)
    assert fsdp.losses == pytest.approx(ddp.losses, rel=1e-5)
    assert ddp.losses != pytest.approx(one.losses, rel=1e-3)  # 2 replicas see 2x the data
    for key, value in weights(fsdp).items():
        assert (value - weights(ddp)[key]).abs().max() < 1e-5


def test_a_killed_rank_resumes_to_the_same_losses_and_weights(workspace):
    reference = run(workspace, "ref", nproc_per_node=2, max_steps=6)
    config = make_config(workspace, "crash", nproc_per_node=2, max_steps=6)
    # Rank 1 SIGKILLs itself right after update 3; the last checkpoint is at update 2.
    crash_env = {**ENV, "SPLITSTAGE_FAULT_KILL": "1:3"}
    with pytest.raises(TorchrunError) as failure:
        train(config, run_root=workspace / "runs", env=crash_env, on_line=lambda line: None)
    assert failure.value.result.failed_rank == 1
    lines: list[str] = []
    resumed = train(config, run_root=workspace / "runs", env=ENV, on_line=lines.append)
    assert any("resumed from checkpoint step 2" in line for line in lines)
    assert resumed.losses == reference.losses
    for key, value in weights(reference).items():
        assert (weights(resumed)[key] == value).all(), key


def test_checkpoint_saved_on_two_ranks_resumes_on_one(workspace):
    first = run(workspace, "reshard", nproc_per_node=2, max_steps=2)
    assert first.updates == 2
    lines: list[str] = []
    config = make_config(workspace, "reshard", max_steps=4)
    second = train(config, run_root=workspace / "runs", env=ENV, on_line=lines.append)
    assert any("resumed from checkpoint step 2" in line for line in lines)
    assert second.updates == 4 and len(second.losses) == 4


def test_checkpoints_and_outputs_on_s3(workspace, s3_bucket, monkeypatch):
    url, options = s3_bucket
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    config = make_config(workspace, "s3", checkpoint_url=f"{url}/ckpt")
    config.cache.storage_options = {"endpoint_url": options["client_kwargs"]["endpoint_url"]}
    config.cache.url = str(workspace / "cache")
    report = train_config(workspace, config)
    assert report.updates == 3
    from splitstage.tasks.stage2.checkpoint import latest_checkpoint

    endpoint = {"endpoint_url": options["client_kwargs"]["endpoint_url"]}
    assert latest_checkpoint(f"{url}/ckpt", storage_options=endpoint) == 3


def test_two_torchrun_agents_form_one_two_node_job(workspace):
    from splitstage.process.torchrun import free_port

    config = make_config(
        workspace, "nodes", nnodes=2, nproc_per_node=1, rdzv_endpoint=f"127.0.0.1:{free_port()}"
    )
    reports = {}

    def node(rank: int) -> None:
        reports[rank] = train(
            config,
            node_rank=rank,
            run_root=workspace / f"runs-node{rank}",
            env=ENV,
            on_line=lambda line: None,
        )

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    losses = [r.losses for r in reports.values() if r.losses]
    assert len(losses) == 1 and len(losses[0]) == 3  # global rank 0 reports, on one node
    assert any(r.world_size == 2 for r in reports.values() if r.losses)


@pytest.mark.parametrize(
    ("train_fields", "message"),
    [
        ({"nproc_per_node": 2, "parallelism": "tp", "tp_degree": 4}, "train.tp_degree=4"),
        ({"parallelism": "zero"}, "train.parallelism"),
    ],
)
def test_bad_layouts_fail_before_any_process_starts(workspace, train_fields, message):
    with pytest.raises(ConfigError, match=message):
        run(workspace, "bad", **train_fields)


def test_missing_weights_file_is_named_before_launch(workspace):
    config = make_config(workspace, "missing")
    config.models["dit"].weights = str(workspace / "nope.safetensors")
    with pytest.raises(ConfigError, match="models.dit.weights: file .*nope.safetensors"):
        train_config(workspace, config)


def test_weights_file_with_wrong_keys_names_them(workspace):
    from safetensors.torch import load_file as read
    from safetensors.torch import save_file

    state = read(str(workspace / "weights/dit.safetensors"))
    bad = {f"model.{k}": v for k, v in state.items()}
    save_file(bad, str(workspace / "weights/prefixed.safetensors"))
    config = make_config(workspace, "prefixed")
    config.models["dit"].weights = str(workspace / "weights/prefixed.safetensors")
    with pytest.raises(ConfigError, match="models.dit.weights: .*key_prefix"):
        train_config(workspace, config)  # refused before any process starts


def test_full_fine_tuning_exports_every_weight(workspace):
    config = make_config(workspace, "full", parallelism="fsdp", nproc_per_node=2, max_steps=2)
    config.trainable.lora_base_model = None
    config.trainable.full = ["dit"]
    report = train_config(workspace, config)
    exported = weights(report)
    initial = load_file(str(workspace / "weights/dit.safetensors"))
    assert exported.keys() == initial.keys()  # remove_prefix_in_ckpt stripped "pipe.dit."
    changed = [k for k in initial if not (exported[k] == initial[k]).all()]
    assert len(changed) > len(initial) // 2  # the optimizer moved (nearly) every weight
