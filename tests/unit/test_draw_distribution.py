"""The diffusers families' per-sample draws follow diffusers' training scripts' own samplers.

For each family, 10,000 samples draw through the function its training step calls (`ddpm_draw`,
`flow_draw` on the family's own schedule, `drop_captions`), each from its own per-sample
generator; the reference draws as the example scripts do (`torch.randint` over the DDPM
timesteps; `compute_density_for_timestep_sampling` -> indices -> `noise_scheduler_copy.timesteps`
-> `get_sigmas`; `random.random() < proportion_empty_prompts`). Timesteps and sigmas: two-sample
Kolmogorov-Smirnov at p > 0.01; noise: pooled mean, std and KS against N(0, 1); caption dropout:
the rate in a binomial 3-sigma band. Each check is shown to fail on a deliberately shifted sampler.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from splitstage.config.job import config_from_dict
from splitstage.pipelines.diffusers.base import drop_captions
from splitstage.pipelines.diffusers.recipes import ddpm_draw, flow_draw, flow_scheduler
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext
from splitstage.tasks.job_plan import make_plan
from tests.helpers.draw_checks import (
    assert_close_means,
    assert_rate,
    assert_same_distribution,
    assert_standard_normal,
)
from tests.helpers.tiny_diffusers import write_tiny_folder

N = 10_000  # draws per family and sampler
SEED = 7
KEYS = [f"sample-{i:05d}" for i in range(N)]
# kind -> (family name, trained model, latent shape of one sample as the training step sees it)
KINDS = {
    "sd": ("sd", "unet", (4, 2, 2)),
    "sdxl": ("sdxl", "unet", (4, 2, 2)),
    "sd3": ("sd3", "transformer", (16, 2, 2)),
    "flux": ("flux", "transformer", (16, 2, 2)),
    "qwenimage": ("qwenimage", "transformer", (16, 1, 2, 2)),
    "wan": ("wan", "transformer", (16, 1, 2, 2)),
    "zimage": ("zimage", "transformer", (16, 2, 2)),
}
FLOW_KINDS = ("sd3", "flux", "qwenimage", "wan", "zimage")
# Each flow family at its default density (None), and every density the scripts offer.
FLOW_CASES = [
    *((kind, None) for kind in FLOW_KINDS),
    ("sd3", "mode"),
    ("sd3", "none"),
    ("flux", "logit_normal"),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One tiny diffusers folder per family (only its configs matter here)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("draw_folders")
    return {kind: write_tiny_folder(kind, root / kind) for kind in KINDS}


def family_of(folders, kind: str, **settings):
    """The family of a job on `kind`'s folder with these `[pipeline]` settings."""
    name, denoiser, _ = KINDS[kind]
    pipeline = {"name": name, "pretrained": str(folders[kind]), "resolution": 64, **settings}
    if kind in ("sd3", "flux", "zimage"):
        pipeline.setdefault("max_prompt_length", 16)  # fits the tiny text encoders
    document = {"pipeline": pipeline, "trainable": {"lora_base_model": denoiser}}
    return make_plan(config_from_dict(document)).family


def per_sample_context(family) -> StepContext:
    """A step over the N keys, each drawing from its own (seed, key, epoch) generator."""
    draws = Draws.per_sample(SEED, KEYS, epoch=0)
    return StepContext({}, torch.device("cpu"), draws, family.settings())


def x0_of(kind: str) -> torch.Tensor:
    """N zero latents shaped as the family's training step sees them."""
    return torch.zeros((N, *KINDS[kind][2]))


def training_schedule(family, kind: str):
    """The schedule the family's training step draws from (Qwen-Image: per token count)."""
    if kind == "qwenimage":
        shape = KINDS[kind][2]
        return family.training_schedule((shape[-2] // 2) * (shape[-1] // 2))
    return family.noise_scheduler


def script_ddpm_timesteps(scheduler, generator: torch.Generator) -> torch.Tensor:
    """diffusers' train_text_to_image(_sdxl).py: `torch.randint(0, num_train_timesteps, (bsz,))`."""
    return torch.randint(0, scheduler.config.num_train_timesteps, (N,), generator=generator)


def script_flow_draw(scheduler, settings: dict, generator: torch.Generator):
    """The dreambooth LoRA scripts (sd3, flux, qwen_image, z_image): density, indices, sigmas."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(
        weighting_scheme=settings["weighting_scheme"],
        batch_size=N,
        logit_mean=settings["logit_mean"],
        logit_std=settings["logit_std"],
        mode_scale=settings["mode_scale"],
        generator=generator,
    )
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices]
    schedule_timesteps = scheduler.timesteps
    step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
    return timesteps, scheduler.sigmas[step_indices].flatten()


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_ddpm_draws_follow_the_text_to_image_scripts(folders, kind):
    family = family_of(folders, kind)
    draw = ddpm_draw(per_sample_context(family), x0_of(kind), family.noise_scheduler)
    reference = script_ddpm_timesteps(family.noise_scheduler, torch.Generator().manual_seed(0))
    assert_same_distribution(draw["timestep"], reference, f"{kind} timesteps")
    assert_standard_normal(draw["noise"], f"{kind} noise")


def test_ddpm_noise_offset_follows_the_script(folders):
    family = family_of(folders, "sd", noise_offset=0.1)
    draw = ddpm_draw(per_sample_context(family), x0_of("sd"), family.noise_scheduler)
    generator = torch.Generator().manual_seed(0)
    x0 = x0_of("sd")  # the script: noise += offset * randn((B, C, 1, 1))
    noise = torch.randn(x0.shape, generator=generator)
    noise += 0.1 * torch.randn((*x0.shape[:2], 1, 1), generator=generator)
    assert_same_distribution(draw["noise"], noise, "sd noise with noise_offset")


@pytest.mark.parametrize(("kind", "scheme"), FLOW_CASES)
def test_flow_draws_follow_the_dreambooth_scripts(folders, kind, scheme):
    settings = {} if scheme is None else {"weighting_scheme": scheme}
    if kind == "qwenimage":
        settings["dynamic_shift"] = False  # as the script (the default shifts per token count)
    family = family_of(folders, kind, **settings)
    schedule = training_schedule(family, kind)
    draw = flow_draw(per_sample_context(family), x0_of(kind), schedule)
    # x0 = 0, so x_t = sigma * noise: the sigma each sample was noised with.
    sigmas = draw["latents"].flatten(1)[:, 0] / draw["noise"].flatten(1)[:, 0]
    generator = torch.Generator().manual_seed(0)
    timesteps, reference_sigmas = script_flow_draw(schedule, family.settings(), generator)
    assert_same_distribution(draw["timestep"], timesteps, f"{kind} {scheme} timesteps")
    assert_same_distribution(sigmas, reference_sigmas, f"{kind} {scheme} sigmas")
    assert_standard_normal(draw["noise"], f"{kind} {scheme} noise")


def test_wan_draws_follow_the_script_on_the_flow_shift_table(folders):
    """No diffusers Wan script: the SD3 sampler on the flow_shift table WanPipeline uses."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    family = family_of(folders, "wan", weighting_scheme="logit_normal")
    draw = flow_draw(per_sample_context(family), x0_of("wan"), family.noise_scheduler)
    table = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # flow_shift
    timesteps, _ = script_flow_draw(table, family.settings(), torch.Generator().manual_seed(0))
    assert_same_distribution(draw["timestep"], timesteps, "wan timesteps")


def test_qwenimage_default_draws_from_the_pipelines_shifted_table(folders):
    """dynamic_shift (default): the script's sampler on the table shifted for 4096 tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    family = family_of(folders, "qwenimage")
    draw = flow_draw(per_sample_context(family), x0_of("qwenimage"), family.training_schedule(4096))
    config = family.scheduler_config
    table = FlowMatchEulerDiscreteScheduler.from_config(config)
    bounds = [config[k] for k in ("base_image_seq_len", "max_image_seq_len")]
    mu = calculate_shift(4096, *bounds, config["base_shift"], config["max_shift"])
    table.set_timesteps(1000, mu=mu)
    shifted, _ = script_flow_draw(table, family.settings(), torch.Generator().manual_seed(0))
    assert_same_distribution(draw["timestep"], shifted, "qwenimage shifted for 4096 tokens")
    unshifted, _ = script_flow_draw(
        family.noise_scheduler, family.settings(), torch.Generator().manual_seed(0)
    )
    with pytest.raises(AssertionError, match="KS p"):  # not train_dreambooth_lora_qwen_image's
        assert_same_distribution(draw["timestep"], unshifted, "qwenimage unshifted")


@pytest.mark.parametrize("kind", ["sd", "flux", "qwenimage"])
def test_caption_dropout_rate_is_binomial(folders, kind):
    chance = 0.1
    family = family_of(folders, kind, caption_dropout=chance)
    embeds = torch.ones((N, 1))
    out = drop_captions(
        per_sample_context(family), prompt_embeds=embeds, empty_prompt_embeds=torch.zeros(1, 1)
    )
    dropped = int((out["prompt_embeds"] == 0).sum())
    rng = random.Random(0)  # the scripts: random.random() < proportion_empty_prompts
    reference = sum(rng.random() < chance for _ in range(N))
    assert_rate(dropped, N, chance, f"{kind} caption dropout")
    assert_rate(reference, N, chance, "script caption dropout")
    pooled = math.sqrt(2 * N * chance * (1 - chance))
    assert abs(dropped - reference) <= 3 * pooled


# -- each check can fail -------------------------------------------------------------------------
def test_ks_check_fails_for_shifted_samplers(folders):
    """Shift applied twice, the unshifted table, uniform over ids, a shorter DDPM range."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    family = family_of(folders, "sd3")
    settings = family.settings()
    draw = flow_draw(per_sample_context(family), x0_of("sd3"), family.noise_scheduler)
    twice = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=9.0)  # 3 after 3
    unshifted = flow_scheduler({**family.scheduler_config, "shift": 1.0})
    uniform = {**settings, "weighting_scheme": "none"}
    wrong = ((twice, settings), (unshifted, settings), (family.noise_scheduler, uniform))
    for schedule, used in wrong:
        timesteps, _ = script_flow_draw(schedule, used, torch.Generator().manual_seed(0))
        with pytest.raises(AssertionError, match="KS p"):
            assert_same_distribution(draw["timestep"], timesteps, "shifted")
    ddpm = family_of(folders, "sd")
    ours = ddpm_draw(per_sample_context(ddpm), x0_of("sd"), ddpm.noise_scheduler)["timestep"]
    shorter = torch.randint(0, 950, (N,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="KS p"):
        assert_same_distribution(ours, shorter, "shorter range")


def test_noise_and_rate_checks_fail_when_shifted():
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn((N, 16), generator=generator)
    assert_standard_normal(noise, "N(0, 1)")
    with pytest.raises(AssertionError, match="std"):
        assert_standard_normal(noise * 1.02, "wider")
    with pytest.raises(AssertionError, match="mean"):
        assert_standard_normal(noise + 0.01, "off centre")
    assert_rate(1000, N, 0.1, "exact")
    with pytest.raises(AssertionError, match="chance"):
        assert_rate(1100, N, 0.1, "too many")
    ours, theirs = torch.randn(400, generator=generator), torch.randn(400, generator=generator)
    assert_close_means(ours, theirs, "same", within=3.0)  # these two differ by 2.05 SE
    with pytest.raises(AssertionError, match="SE"):
        assert_close_means(ours + 0.3, theirs, "shifted mean")
