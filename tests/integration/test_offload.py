"""train.offload = "cpu": the trained model's weights in host memory through FSDP2's
CPUOffloadPolicy, each block on the device only while it runs.

On this CPU the device is the host, so what is checked is the machinery (FSDP2 shards held by
the offload policy, gathered per block in forward and backward) and that it changes nothing:
the loss and every gradient equal the run without offload, LoRA and full fine-tuning, in one
process (a one-rank FSDP2 mesh) and on 2 gloo ranks through the launcher. What it saves on a GPU
is measured by bench/gpu_check.sh.
Run: .venv/bin/pytest -m slow tests/integration/test_offload.py
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage2.distributed import close_distributed, init_distributed
from tests.helpers.stage2_step import (
    demo_config,
    demo_files,
    flux_config,
    seed_adapters,
    step_loss,
    trained_model,
)
from tests.helpers.tiny_job import make_workspace, tiny_config

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
TRAINING = {"lora": None, "full": {"full": ["dit"]}}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return demo_files(tmp_path_factory.mktemp("offload"))


@pytest.fixture(scope="module")
def one_rank_group():
    """The one-rank process group a rank of a one-process job joins (closed afterwards, so the
    test process is left as it was found)."""
    init_distributed(device="cpu")
    yield
    close_distributed()


def step(config):
    """(log line, loss, {parameter: full gradient}) of one step of the stage-2 build."""
    lines: list[str] = []
    plan, model = trained_model(config, lines)
    if config.trainable.lora_base_model:
        seed_adapters(model)
    loss = step_loss(plan, model)
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grad = param.grad
            grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return lines[0], model, loss.item(), grads


@pytest.mark.parametrize(
    ("family", "training"), [("demo", "lora"), ("demo", "full"), ("flux", "lora")]
)
def test_offload_changes_nothing_but_where_the_weights_live(root, one_rank_group, family, training):
    make = demo_config if family == "demo" else flux_config
    args = (root, TRAINING[training]) if family == "demo" else (root,)
    line, plain, loss, grads = step(make(*args))
    line_off, model, loss_off, grads_off = step(make(*args, offload="cpu"))
    assert line_off == f"{line} (in host memory: train.offload = 'cpu')"
    groups = [
        m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)
    ]
    groups = [group for group in groups if group is not None]
    assert groups and all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters())
    assert not any(isinstance(p, DTensor) for p in plain.parameters())
    assert loss_off == loss and set(grads_off) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_off[name], grad, rtol=0, atol=0, msg=name)


def test_two_fsdp_ranks_with_offload_train_as_without(tmp_path):
    workspace = make_workspace(tmp_path, samples=8, seed=0)
    losses = {}
    for offload in ("none", "cpu"):
        train_settings = {"parallelism": "fsdp", "nproc_per_node": 2, "max_steps": 2}
        config = tiny_config(
            workspace, f"off-{offload}", 0, batch_size=2, offload=offload, **train_settings
        )
        lines: list[str] = []
        report = train(config, run_root=workspace / "runs", env=ENV, on_line=lines.append)
        assert report.updates == 2 and all(math.isfinite(x) for x in report.losses)
        assert any("train.offload" in line for line in lines) == (offload == "cpu")
        losses[offload] = report.losses
    assert losses["cpu"] == losses["none"]
