"""train.gradient_checkpointing: the same loss and gradients, activations really recomputed.

In-process on the real stage-2 build (meta -> LoRA -> checkpointing -> load) for the demo DiT and
a tiny diffusers FLUX transformer; under torchrun, FSDP2 with checkpointing equals FSDP2 without;
a family that cannot recompute a model is refused before launch with one line.
Run: .venv/bin/pytest -m slow tests/integration/test_gradient_checkpointing.py
"""

from __future__ import annotations

import pytest
import torch

from splitstage.config.job import ConfigError
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage2.parallelize import find_blocks
from splitstage.tasks.stage2.preflight import check_gradient_checkpointing
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
CONFIGS = {"demo": demo_config, "flux": flux_config}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return demo_files(tmp_path_factory.mktemp("gc"))


def checkpointed_step(root, family: str, on: bool):
    """(loss, LoRA gradients, block forward calls) of one step with checkpointing on / off."""
    plan, model = trained_model(CONFIGS[family](root, gradient_checkpointing=on))
    seed_adapters(model)
    blocks = find_blocks(model)
    assert len(blocks) >= 3
    calls = []
    for block in blocks:
        block.register_forward_pre_hook(lambda module, args: calls.append(module))
    loss = step_loss(plan, model)
    forward_calls = len(calls)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, forward_calls, len(calls)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_checkpointing_gives_the_same_loss_and_gradients_and_recomputes_each_block(root, family):
    loss_off, grads_off, forward_off, total_off = checkpointed_step(root, family, on=False)
    loss_on, grads_on, forward_on, total_on = checkpointed_step(root, family, on=True)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=0)
    assert grads_on.keys() == grads_off.keys() and grads_off
    assert all(".lora_" in name for name in grads_off)
    for name, grad in grads_off.items():
        assert grad.abs().max() > 0, name  # every adapter learns (B was seeded non-zero)
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-7)
    # Without checkpointing each block runs once; with it, once more in backward.
    assert forward_off == forward_on == total_off
    assert total_on == 2 * forward_on


def test_a_model_the_family_cannot_recompute_is_refused_in_one_line(root):
    config = demo_config(root, trainable={"full": ["vae"]}, gradient_checkpointing=True)
    plan = make_plan(config)
    with pytest.raises(ConfigError) as error:
        check_gradient_checkpointing(plan)
    message = str(error.value)
    assert "train.gradient_checkpointing" in message and "demo" in message
    assert "'vae'" in message and "\n" not in message
    with pytest.raises(ConfigError, match="train.gradient_checkpointing"):
        plan.family.enable_gradient_checkpointing("vae", torch.nn.Linear(2, 2))
    for make in (demo_config, flux_config):  # the DiT, FLUX's transformer: accepted
        config = make(root, gradient_checkpointing=True)
        check_gradient_checkpointing(make_plan(config))


def test_fsdp_with_checkpointing_equals_fsdp_without_and_refusals_come_before_launch(
    tmp_path_factory,
):
    workspace = make_workspace(tmp_path_factory.mktemp("gc-run"), samples=16, seed=3)
    lines: list[str] = []

    def run(name: str, **train_fields):
        config = tiny_config(workspace, name, 3, max_steps=2, **train_fields)
        env = {"SPLITSTAGE_DEVICE": "cpu"}
        return train(config, run_root=workspace / "runs", env=env, on_line=lines.append)

    fields = {"nproc_per_node": 2, "parallelism": "fsdp", "batch_size": 2}
    plain = run("fsdp-plain", **fields)
    recomputed = run("fsdp-gc", gradient_checkpointing=True, **fields)
    assert recomputed.updates == plain.updates == 2
    assert recomputed.losses == pytest.approx(plain.losses, rel=1e-5)
