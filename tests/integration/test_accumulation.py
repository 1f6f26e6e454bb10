"""Gradient accumulation has one owner: after k micro-batches the gradient is the mean of their
gradients (accelerate divides the loss once; dividing it again made it 1/k of that)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from splitstage.pipelines.runtime import StepContext, run_units
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2.distributed import close_distributed
from splitstage.tasks.stage2.launch import write_spec
from splitstage.tasks.stage2.outputs import run_paths
from splitstage.tasks.stage2.preflight import preflight
from splitstage.tasks.stage2.trainer import Trainer, step_generator, to_device
from tests.helpers.tiny_job import make_workspace, tiny_config


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("accumulation"), samples=16, seed=0)


def one_rank_trainer(workspace: Path, accum: int) -> Trainer:
    """A rank of a real run spec, in this process (a one-rank group, as without torchrun)."""
    config = tiny_config(workspace, f"accum{accum}", 0, gradient_accumulation_steps=accum)
    plan = make_plan(config)
    paths = run_paths(config, f"accum{accum}", workspace / "runs")
    checks = preflight(config, plan, paths)
    run_dir = Path(paths["run_dir"])
    spec = write_spec(config, run_dir.name, plan.cache_key, run_dir, paths, checks)
    return Trainer(json.loads(spec.read_text()))


def plain_gradient(trainer: Trainer, batch, batch_index: int) -> list[torch.Tensor]:
    """One micro-batch's loss gradient by plain autograd (no accelerate), with the same draws."""
    ctx = StepContext(
        models=trainer.stage2.models,
        device=trainer.dist.device,
        generator=step_generator(trainer.config.job.seed, 0, batch_index, trainer.dist.device),
        settings=trainer.family.settings(),
    )
    params = trainer.stage2.parameters()
    for param in params:
        param.grad = None
    inputs = to_device(batch, trainer.dist.device)
    run_units(trainer.units, ctx, inputs)
    trainer.family.training_loss(ctx, inputs).backward()
    return [param.grad.detach().clone() for param in params]


def test_accumulated_gradient_is_the_mean_of_the_micro_batches(workspace):
    try:
        trainer = one_rank_trainer(workspace, accum=2)
        batches = list(itertools.islice(trainer.source.iterate(0, 0), 2))
        model = trainer.trained_models()[0]
        for index, batch in enumerate(batches):
            with trainer.accelerator.accumulate(model):
                trainer.micro_step(batch, index)
        accumulated = [param.grad.detach().clone() for param in trainer.stage2.parameters()]
        first, second = (plain_gradient(trainer, b, i) for i, b in enumerate(batches))
    finally:
        close_distributed()
    assert any(g.abs().sum() > 0 for g in accumulated)
    for got, a, b in zip(accumulated, first, second, strict=True):
        # float32 sums of the same terms in another order: a few ulps of the gradient's scale
        torch.testing.assert_close(got, (a + b) / 2, rtol=1e-5, atol=1e-7)
