"""The diffsynth family's per-sample draws follow DiffSynth's own training sampler (tiny Z-Image).

Ours: the family's `training_loss` on a cached sample, each of 10,000 sample keys drawing from
its own (seed, key, epoch) seed. Theirs: DiffSynth's `FlowMatchSFTLoss` on its own units'
outputs, the global RNG seeded once and drawn step after step (its train.py seeds nothing).
A tap on the scheduler's `training_target` (DiffSynth calls it with the noise and timestep it
drew, just before `model_fn`) records both and stops the step there. Timesteps and sigmas:
two-sample KS at p > 0.01; noise: pooled mean/std, KS against N(0, 1) and against DiffSynth's.
The mean loss of the real model over 200 draws each is within 2 standard errors of DiffSynth's.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest
import torch
from diffsynth.diffusion.loss import FlowMatchSFTLoss

from splitstage.data.digits import write_digits_dataset
from splitstage.data.index import index_data_set
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext
from splitstage.tasks.cache.reader import CacheDataset
from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models
from tests.helpers.diffsynth_jobs import SEED, fresh, job, registered
from tests.helpers.draw_checks import (
    assert_close_means,
    assert_same_distribution,
    assert_standard_normal,
)
from tests.helpers.tiny_diffsynth import write_tiny_models

NAME = "ZImagePipeline"
DRAWS = 10_000  # per sampler, for the distributions
LOSSES = 200  # per sampler, for the mean loss (each runs the tiny DiT)
CPU = torch.device("cpu")


class Drawn(Exception):
    """Raised by the tap once DiffSynth's step has drawn (the model is not run)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A cached sample, the family and its stage-2 DiT; DiffSynth's pipe and its units' outputs."""
    root = tmp_path_factory.mktemp("draws")
    write_digits_dataset(root / "data", limit=1, size=32)
    info = write_tiny_models(NAME, root / NAME)
    (root / NAME / "info.json").write_text(json.dumps(info))
    config = job(root, NAME)
    plan = make_plan(config)
    with registered([info]):
        report = preprocess(config, progress=False)
        dataset = CacheDataset(CacheStore(config.cache.url, report.cache_key))
        batch = next(iter(dataset.iterate_keys([[dataset.keys[0]]], prefetch=0)))
        dist_info = DistInfo(0, 0, 1, CPU, "gloo")
        models = build_stage2_models(plan, dist_info, names=["dit"]).models
        pipe = fresh(NAME, info)
    row = index_data_set(config).rows[0]
    sample = plan.family.load_sample(row, config.data.base_path)
    posi = {"prompt": sample.pop("prompt")}
    nega = {"negative_prompt": sample.pop("negative_prompt")}
    inputs = ({k: v for k, v in sample.items() if v is not None}, posi, nega)
    with torch.no_grad():
        for unit in pipe.units:
            inputs = pipe.unit_runner(unit, pipe, *inputs)
    return plan.family, models, batch, pipe, {**inputs[0], **inputs[1]}


@contextlib.contextmanager
def tap(scheduler, stop: bool) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Record (timestep, noise) at each `training_target` call; `stop`: raise Drawn there."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    target = scheduler.training_target

    def record(sample, noise, timestep):
        seen.append((timestep.detach().float().flatten(), noise.detach().float().flatten()))
        if stop:
            raise Drawn
        return target(sample, noise, timestep)

    scheduler.training_target = record
    try:
        yield seen
    finally:
        del scheduler.training_target  # the class's own method again


@pytest.fixture(scope="module")
def drawn(setup):
    """DRAWS (timestep, noise) pairs from our training_loss and from DiffSynth's loss."""
    family, models, batch, pipe, inputs = setup
    with tap(family.pipe.scheduler, stop=True) as our_draws:
        ours(family, models, batch, DRAWS)
    with tap(pipe.scheduler, stop=True) as their_draws:
        theirs(pipe, inputs, DRAWS, seed=0)
    return our_draws, their_draws


def ours(family, models, batch, count: int, offset: int = 0) -> list[float]:
    """The family's training_loss for `count` sample keys (losses; NaN when the tap stopped)."""
    losses = []
    for i in range(offset, offset + count):
        ctx = StepContext(models, CPU, Draws.per_sample(SEED, [f"key-{i:05d}"], 0))
        try:
            with torch.no_grad():
                losses.append(float(family.training_loss(ctx, dict(batch))))
        except Drawn:
            losses.append(float("nan"))
    return losses


def theirs(pipe, inputs, count: int, seed: int) -> list[float]:
    """DiffSynth's FlowMatchSFTLoss `count` times from one seeded global RNG, as train.py."""
    losses = []
    torch.manual_seed(seed)
    for _ in range(count):
        try:
            with torch.no_grad():
                losses.append(float(FlowMatchSFTLoss(pipe, **inputs)))
        except Drawn:
            losses.append(float("nan"))
    return losses


def sigmas_of(scheduler, timesteps: torch.Tensor) -> torch.Tensor:
    """The sigma DiffSynth's add_noise takes for each timestep (its nearest table row)."""
    rows = (scheduler.timesteps[None, :] - timesteps[:, None]).abs().argmin(dim=1)
    return scheduler.sigmas[rows]


def test_timestep_and_noise_draws_follow_diffsynths_sampler(setup, drawn):
    pipe = setup[3]
    our_draws, their_draws = drawn
    assert len(our_draws) == len(their_draws) == DRAWS
    our_t = torch.cat([t for t, _ in our_draws])
    their_t = torch.cat([t for t, _ in their_draws])
    # DiffSynth casts the drawn row's timestep to pipe.torch_dtype (bf16): ~350 distinct values.
    assert our_t.unique().numel() > 300
    assert_same_distribution(our_t, their_t, "timesteps")
    scheduler = pipe.scheduler
    assert_same_distribution(sigmas_of(scheduler, our_t), sigmas_of(scheduler, their_t), "sigmas")
    our_noise = torch.stack([n for _, n in our_draws])  # [DRAWS, values per sample]
    their_noise = torch.stack([n for _, n in their_draws])
    assert_standard_normal(our_noise, "noise", ks_values=DRAWS)
    assert_standard_normal(our_noise[:, 0], "each sample's first noise value")
    assert_same_distribution(our_noise, their_noise, "noise against DiffSynth's")


def test_the_check_fails_on_an_otherwise_shifted_table(setup, drawn, monkeypatch):
    """The same check fails against DiffSynth's sampler on its table shifted by 1, not 3."""
    pipe, inputs = setup[3], setup[4]
    sigmas, timesteps = pipe.scheduler.set_timesteps_fn(num_inference_steps=1000, shift=1.0)
    monkeypatch.setattr(pipe.scheduler, "timesteps", timesteps)
    monkeypatch.setattr(pipe.scheduler, "sigmas", sigmas)
    with tap(pipe.scheduler, stop=True) as their_draws:
        theirs(pipe, inputs, DRAWS // 2, seed=1)
    our_t = torch.cat([t for t, _ in drawn[0]])
    their_t = torch.cat([t for t, _ in their_draws])
    with pytest.raises(AssertionError, match="KS p"):
        assert_same_distribution(our_t, their_t, "shift 1 table")


def test_mean_loss_is_within_two_standard_errors_of_diffsynths(setup):
    """The real tiny DiT, initial weights: 200 of our draws against 200 of DiffSynth's steps."""
    family, models, batch, pipe, inputs = setup
    our_losses = torch.tensor(ours(family, models, batch, LOSSES))
    their_losses = torch.tensor(theirs(pipe, inputs, LOSSES, seed=0))
    assert our_losses.isfinite().all() and their_losses.isfinite().all()
    assert_close_means(our_losses, their_losses, "mean loss")
