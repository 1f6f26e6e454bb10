"""With gradient accumulation the gradients are reduced across replicas once per update, with
the update's last micro-batch, under DDP (composable `replicate`) and FSDP2: neither wrapper has
the `no_sync` accelerate's `accumulate` looks for, so the trainer turns their gradient sync off
for the other micro-batches. Real torchrun (2 ranks, gloo), the real Trainer on a real run spec;
the collectives are counted with torch's profiler. The update stays exact: 2 ranks x 4
micro-batches of 1 train as one process with batches of 8.
Run: .venv/bin/pytest -m slow tests/integration/test_gradient_sync.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitstage.process.torchrun import TorchrunSpec, run_torchrun
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage2.outputs import run_places
from splitstage.tasks.stage2.run_spec import SPEC_FILE, RunSpec
from tests.helpers.tiny_job import make_workspace, tiny_config

pytestmark = pytest.mark.slow
WORKERS = Path(__file__).parent / "workers"
ROOT = Path(__file__).resolve().parents[2]
ENV = {"SPLITSTAGE_DEVICE": "cpu", "PYTHONPATH": f"{ROOT}{os.pathsep}{WORKERS}"}
ACCUMULATION = 4
UPDATES = 2
# AdamW's eps well above |g|: an update is ~ lr * g / eps, linear in the gradient (see
# test_accumulation), so float noise of the gradient stays float noise of the weights
FIELDS = {"max_steps": UPDATES, "checkpoint_every": UPDATES, "optimizer_args": {"eps": 1e-2}}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("gradient-sync"), samples=16, seed=0)


@pytest.fixture(scope="module")
def one_process(workspace: Path):
    """The reference: one process, one micro-batch of 8 per update."""
    config = tiny_config(workspace, "one", 0, batch_size=8, **FIELDS)
    return train(config, run_root=workspace / "runs", env=ENV, on_line=lambda line: None)


def counted_run(workspace: Path, parallelism: str) -> dict:
    """2 ranks x ACCUMULATION micro-batches of 1 under `parallelism`; rank 0's record."""
    name = f"sync-{parallelism}"
    config = tiny_config(
        workspace,
        name,
        0,
        batch_size=1,
        gradient_accumulation_steps=ACCUMULATION,
        nproc_per_node=2,
        parallelism=parallelism,
        **FIELDS,
    )
    places = run_places(config, name, workspace / "runs")
    spec = RunSpec(config=config, run_id=name, places=places)
    path = spec.write(Path(places.run_dir) / SPEC_FILE)
    out = workspace / name
    out.mkdir()
    worker = TorchrunSpec(
        str(WORKERS / "sync_worker.py"), [str(path), str(out)], nproc_per_node=2, env=ENV
    )
    result = run_torchrun(worker, timeout=300)
    assert result.ok, "\n".join(result.output_tail)
    records = [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(2)]
    assert records[0]["micro"] == records[1]["micro"]  # collectives: every rank alike
    return records[0]


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_gradients_are_reduced_once_per_update_and_the_update_is_exact(
    workspace, one_process, parallelism
):
    record = counted_run(workspace, parallelism)
    # DDP: one bucket (the LoRA tensors are small), one all-reduce; FSDP2: one reduction per
    # parameter group holding trained parameters (each block, the root)
    once = 1 if parallelism == "ddp" else record["groups"]
    assert once == 1 or (parallelism == "fsdp" and once > 1)
    reduced = [sum(counts.values()) for counts in record["micro"]]
    assert reduced == ([0] * (ACCUMULATION - 1) + [once]) * UPDATES, record["micro"]
    assert record["losses"] == pytest.approx(one_process.losses, rel=1e-5)
    got, want = load_file(record["outputs"]["dit"]), load_file(one_process.outputs["dit"])
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-4, atol=1e-7)
