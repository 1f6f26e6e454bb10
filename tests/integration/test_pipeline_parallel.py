"""Pipeline-parallel stage 2 under real torchrun (2 stages, gloo, CPU) against one process.

Tiny data (32 digits), the tiny text encoder, the demo DiT (6 blocks: stage 0 holds the embedders
and blocks 0-2, stage 1 blocks 3-5 and the head); one preprocessing run serves all tests.
Run: .venv/bin/pytest -m slow tests/integration/test_pipeline_parallel.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from splitstage.config.job import ConfigError
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage2.pp_trainer import check_pp_config
from tests.helpers.tiny_job import make_workspace, tiny_config

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu"}
SEED = 5
PP = {"nproc_per_node": 2, "parallelism": "pp", "pp_microbatches": 2}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A digits subset, demo weights and a filled cache, shared by the module's tests."""
    return make_workspace(tmp_path_factory.mktemp("pp"), samples=32, seed=SEED)


def make_config(root: Path, name: str, **fields):
    """A tiny LoRA job config; `fields` override [train] fields."""
    return tiny_config(root, name, SEED, **{"max_steps": 4, **fields})


def run(root: Path, name: str, lines: list[str] | None = None, **fields):
    """Train a config to the end (resuming from its checkpoints); return the report."""
    on_line = lines.append if lines is not None else (lambda line: None)
    config = make_config(root, name, **fields)
    return train(config, run_root=root / "runs", env=ENV, on_line=on_line)


@pytest.fixture(scope="module")
def one_process(workspace):
    """The reference: the same job on one process."""
    return run(workspace, "one")


def test_stages_come_from_the_splitter_assignment(workspace):
    stages = check_pp_config(make_config(workspace, "stages", **PP))
    assert stages == [
        ["patch_embed", "time_embed", "text_proj", "blocks.0", "blocks.1", "blocks.2"],
        ["blocks.3", "blocks.4", "blocks.5", "norm", "proj_out"],
    ]


@pytest.mark.parametrize(
    ("train_fields", "message"),
    [
        ({"pp_microbatches": 1}, r"train.pp_microbatches=1 .* set train.pp_microbatches >= 2"),
        ({"pp_microbatches": 3}, r"train.batch_size=4 .* pp_microbatches in \[2, 4\]"),
        ({"nproc_per_node": 6, "pp_microbatches": 8, "batch_size": 8}, "use at most 4 ranks"),
        ({"tp_degree": 2}, "train.tp_degree=2"),
        ({"weights_loading": "broadcast"}, "train.weights_loading"),
    ],
)
def test_bad_pipeline_settings_fail_before_any_process_starts(workspace, train_fields, message):
    config = make_config(workspace, "bad", **(PP | train_fields))
    with pytest.raises(ConfigError, match=message):
        check_pp_config(config)
    with pytest.raises(ConfigError, match=message):
        train(config, run_root=workspace / "runs", env=ENV, on_line=lambda line: None)
    assert not (workspace / "runs" / "bad" / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def pipeline(workspace):
    """Two stages: 2 updates, then the same run id to 4 updates (resumes); (first, resumed, log)."""
    first = run(workspace, "pp", **(PP | {"max_steps": 2}))
    lines: list[str] = []
    resumed = run(workspace, "pp", lines, **PP)
    return first, resumed, lines


def test_pipeline_equals_one_process(one_process, pipeline):
    first, resumed, _ = pipeline
    assert first.parallelism == "pp" and first.world_size == 2 and first.models_loaded == ["dit"]
    assert first.losses == pytest.approx(one_process.losses[:2], rel=1e-5)
    assert resumed.losses == pytest.approx(one_process.losses, rel=1e-5)
    exported, reference = load_file(resumed.outputs["dit"]), load_file(one_process.outputs["dit"])
    assert sorted(exported) == sorted(reference)
    assert any(key.startswith("blocks.0.") for key in exported)  # stage 0's adapters
    assert any(key.startswith("blocks.5.") for key in exported)  # stage 1's adapters
    for key, value in reference.items():
        assert (exported[key] - value).abs().max() < 1e-5, key


def test_pipeline_resumes_from_its_checkpoint(pipeline):
    first, resumed, lines = pipeline
    assert first.updates == 2
    assert any("resumed from checkpoint step 2" in line for line in lines)
    assert resumed.updates == 4 and len(resumed.losses) == 4


def test_pipeline_stages_recompute_activations_with_the_same_losses(workspace, pipeline):
    first, _, _ = pipeline
    lines: list[str] = []
    recomputed = run(
        workspace, "pp-gc", lines, **(PP | {"max_steps": 2}), gradient_checkpointing=True
    )
    assert recomputed.parallelism == "pp" and recomputed.updates == 2
    assert recomputed.losses == pytest.approx(first.losses, rel=1e-5)
