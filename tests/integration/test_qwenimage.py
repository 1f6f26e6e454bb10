"""Qwen-Image through diffusers (`[pipeline] name = "qwenimage"`) on a tiny Hub-style folder with
the real classes (QwenImageTransformer2DModel, AutoencoderKLQwenImage, Qwen2.5-VL, Qwen2Tokenizer):
the split plan, our training loss against the diffusers computation for the same noise and
timesteps, the sampler against QwenImagePipeline, and plan -> preprocess -> torchrun training ->
an export QwenImagePipeline.load_lora_weights reproduces.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from splitstage.config.job import ConfigError
from splitstage.pipelines.diffusers.qwenimage_latents import pack
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.lora_targets import QWEN_IMAGE_LORA_TARGETS
from splitstage.pipelines.runtime import StepContext, run_units
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2.parallelize import find_blocks
from tests.helpers.diffusers_families import (
    CPU,
    assert_only_stage_1_settings_key_the_cache,
    assert_split_equals_unsplit_and_exports,
    assert_the_encoders_are_cached,
    assert_the_sampler_matches,
    assert_two_ranks_give_the_one_rank_losses,
    cached_prompt_lengths,
    digits_and_folder,
    drawn_step,
    lora_job,
    padded_to,
    split_run_of,
    tiny_pipeline,
    validate_refusal,
)
from tests.helpers.stage2_step import seed_adapters, trained_model

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of the digit 3", "a cat"]
LENGTH = 24  # max_prompt_length: longer than both prompts, so the mask pads


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A captioned data set (4 digits) and the tiny Qwen-Image folder."""
    return digits_and_folder(tmp_path_factory, "qwenimage")


def job(root: Path, name: str, *, pipeline=None, buckets=None, **train):
    """A LoRA job on the tiny folder (see lora_job), prompts LENGTH tokens at most, `buckets`
    the data's buckets."""
    pipeline = {"max_prompt_length": LENGTH} | (pipeline or {})
    data = {"buckets": buckets or {}}
    return lora_job(root, "qwenimage", name, pipeline=pipeline, data=data, **train)


def pipeline(root: Path):
    """QwenImagePipeline from the same folder (offline)."""
    return tiny_pipeline(root, "QwenImagePipeline", "qwenimage")


def test_the_plan_caches_prompt_and_vae_encoding_and_trains_the_transformer(root):
    plan = make_plan(job(root, "plan"))
    assert_the_encoders_are_cached(
        plan, {"prompt_embeds", "prompt_embeds_mask", "empty_prompt_embeds_mask"}
    )
    # the source text's targets in every block, less the last block's text stream (no gradient)
    targets = plan.family.lora_targets("transformer")
    for target in QWEN_IMAGE_LORA_TARGETS:
        blocks = {name.split(".")[1] for name in targets if name.endswith(f".{target}")}
        dead = target in ("to_add_out", "txt_mlp.net.2")
        assert blocks == ({"0"} if dead else {"0", "1"}), target
    # a stage-1 setting changes the cache key; per-step ones do not
    per_step = {"dynamic_shift": False, "caption_dropout": 0.5, "weighting_scheme": "logit_normal"}
    assert_only_stage_1_settings_key_the_cache(job, root, plan, per_step)


def test_max_pixels_sizes_the_square_and_the_buckets(root):
    """The source text's max_pixels is an area: the square's side without buckets, the buckets'
    area with them (data.buckets.area still overrides); resolution with it is refused."""
    square = make_plan(job(root, "px", pipeline={"max_pixels": 100 * 100})).family
    assert square.image_resolution() == (96, 16)  # isqrt 100, down to a multiple of 16
    buckets = {"enabled": True, "step": 16}
    bucketed = make_plan(job(root, "px", pipeline={"max_pixels": 64 * 96}, buckets=buckets))
    assert bucketed.family.buckets.area == 64 * 96
    assert (64, 96) in bucketed.family.buckets.sizes and (96, 64) in bucketed.family.buckets.sizes
    area = make_plan(
        job(root, "px", pipeline={"max_pixels": 64 * 96}, buckets=buckets | {"area": 4096})
    )
    assert area.family.buckets.area == 4096
    with pytest.raises(ConfigError, match="max_pixels and resolution"):
        job(root, "px", pipeline={"max_pixels": 4096, "resolution": 64})


def test_the_training_loss_is_the_diffusers_computation(root):
    """Same noise and timesteps: diffusers' train_dreambooth_lora_qwen_image lines on the
    pipeline's own prompt encoding and VAE give our loss; the timesteps lie on the table the
    pipeline's scheduler gives for this image size (its dynamic shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    plan = make_plan(job(root, "loss", pipeline={"vae_latents": "mean"}))
    family = plan.family
    pipe = pipeline(root)
    transformer = pipe.transformer
    batch, ctx, step = drawn_step(plan, transformer, PROMPTS)
    with torch.no_grad():
        ours = family.loss(family.denoise(ctx, step), step)

    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=LENGTH)
        z = pipe.vae.encode(batch["image"].unsqueeze(2)).latent_dist.mode()
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)
    model_input = (z - mean) * inv_std
    bsz, height, width = model_input.shape[0], model_input.shape[3], model_input.shape[4]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        root / "qwenimage", subfolder="scheduler"
    )
    sc = scheduler.config
    mu = calculate_shift(
        (height // 2) * (width // 2),
        sc.base_image_seq_len,
        sc.max_image_seq_len,
        sc.base_shift,
        sc.max_shift,
    )
    scheduler.set_timesteps(sc.num_train_timesteps, mu=mu)
    timesteps = batch["timestep"]
    index = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[index].view(-1, 1, 1, 1, 1)
    noise = batch["noise"].unsqueeze(2)
    noisy = ((1.0 - sigmas) * model_input + sigmas * noise).permute(0, 2, 1, 3, 4)
    packed = QwenImagePipeline._pack_latents(noisy, bsz, model_input.shape[1], height, width)
    with torch.no_grad():
        pred = transformer(
            hidden_states=packed,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=timesteps / 1000,
            img_shapes=[(1, height // 2, width // 2)] * bsz,
            return_dict=False,
        )[0]
    pred = QwenImagePipeline._unpack_latents(pred, 64, 64, pipe.vae_scale_factor)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting * (pred - target) ** 2).reshape(bsz, -1), 1).mean()
    assert mask is not None  # the shorter prompt is padded: the mask matters
    assert ours.item() == pytest.approx(loss.item(), rel=1e-5)


def test_the_sampler_matches_the_qwenimage_pipeline(root):
    plan = make_plan(job(root, "sample"))
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    cfg = {"negative_prompt": ["", ""], "true_cfg_scale": plan.family.default_guidance}
    assert_the_sampler_matches(plan, partial(pipeline, root), PROMPTS, pack(noise), **cfg)


@pytest.fixture(scope="module")
def split_run(root):
    """(config, report) of plan -> preprocess -> split training on one torchrun rank."""
    return split_run_of(job, root)


def test_checkpointing_gives_the_same_loss_and_gradients_and_recomputes_each_block(root):
    """The family's hook (the transformer's own switch) on the real stage-2 build."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, 7:] = 0
    inputs = {
        "input_latents": torch.randn(2, 4, 8, 8, generator=g),
        "prompt_embeds": torch.randn(2, LENGTH, 32, generator=g),
        "prompt_embeds_mask": mask,
    }
    results = []
    for on in (False, True):
        plan, model = trained_model(job(root, "gc", gradient_checkpointing=on))
        seed_adapters(model)
        calls: list[nn.Module] = []
        for block in find_blocks(model):
            block.register_forward_pre_hook(lambda module, args, calls=calls: calls.append(module))
        family = plan.family
        draws = Draws.shared(torch.Generator().manual_seed(1))
        ctx = StepContext({"transformer": model}, CPU, draws, family.settings())
        loss = family.training_loss(ctx, dict(inputs))
        forward = len(calls)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, forward, len(calls)))
    (loss_off, grads_off, forward_off, total_off), (loss_on, grads_on, forward_on, total_on) = (
        results
    )
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=0)
    assert grads_on.keys() == grads_off.keys() and grads_off
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-7)
    assert forward_off == forward_on == total_off == 2  # two blocks, once each
    assert total_on == 2 * forward_on  # recomputed in backward


@pytest.mark.parametrize(("parallelism", "batch_size"), [("tp", 2), ("fsdp", 1), ("ddp", 1)])
def test_two_ranks_give_the_one_rank_losses(root, split_run, parallelism, batch_size):
    """TP (diffusers' plan, heads sharded) on the same batch; FSDP2 and DDP with one sample
    per rank."""
    assert_two_ranks_give_the_one_rank_losses(job, root, split_run, parallelism, batch_size)


def test_split_training_through_torchrun_exports_a_lora_the_pipeline_loads(root, split_run):
    outputs = ("transformer", "transformer_kohya")
    load = partial(pipeline, root)
    assert_split_equals_unsplit_and_exports(job, root, split_run, PROMPTS, load, outputs)


def test_stage_1_caches_each_prompt_at_its_own_length_and_batches_pad_them(root, tmp_path):
    """Each sample's prompt embeddings (and the empty prompt's) are cached at their own token
    count, not max_prompt_length; samples of any prompt length batch together, padded to the
    batch's longest; the transformer predicts for such a batch what it predicts for the same
    batch padded to max_prompt_length."""
    import csv
    import shutil

    from splitstage.tasks.stage1.preprocess import preprocess

    data = shutil.copytree(root / "data", tmp_path / "data")
    with (data / "metadata.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row, prompt in zip(
        rows, ["a cat", "a photo of a 3", "the seven", "an old brown dog"], strict=True
    ):
        row["prompt"] = prompt
    with (data / "metadata.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["image", "prompt"])
        writer.writeheader()
        writer.writerows(rows)
    cache = {"url": str(tmp_path / "cache")}
    config = lora_job(
        root, "qwenimage", "own-length", cache=cache,
        pipeline={"max_prompt_length": LENGTH, "caption_dropout": 0.0},
        data={"base_path": str(data)},
    )  # fmt: skip
    assert preprocess(config, workers=1, progress=False).computed == 4
    plan = make_plan(config)
    dataset, keys, lengths = cached_prompt_lengths(plan)
    assert max(lengths.values()) < LENGTH and len(set(lengths.values())) == 4
    assert set(dataset.groups.tolist()) == {0}  # one shape group: they batch together

    shorter, longer = sorted(keys, key=lengths.get)[1:3]
    batch = next(dataset.iterate_keys([[shorter, longer]], prefetch=0))
    assert batch["prompt_embeds"].shape[1] == lengths[longer]
    assert batch["prompt_embeds_mask"].sum(dim=1).tolist() == [lengths[shorter], lengths[longer]]
    padded = padded_to(plan, batch, LENGTH)  # as stage 1 cached them before
    family = plan.family
    model = family.build_model("transformer", CPU)
    predictions = []
    for inputs in (batch, padded):
        draws = Draws.shared(torch.Generator().manual_seed(1))
        ctx = StepContext({"transformer": model}, CPU, draws, family.settings())
        with torch.no_grad():
            step = family.training_step(ctx, run_units(plan.v1_units, ctx, dict(inputs)))
            predictions.append(family.denoise(ctx, step))
    assert step.denoiser_kwargs["encoder_hidden_states"].shape[1] == LENGTH
    torch.testing.assert_close(predictions[0], predictions[1], atol=1e-5, rtol=0)


def test_a_tokenizer_that_keeps_part_of_the_system_prompt_is_refused_by_validate(root, tmp_path):
    """A tokenizer that encodes the template's prefix into other than the 34 tokens the pipeline
    drops would leave system-prompt tokens in the embeddings, silently: `splitstage validate`
    refuses it in one line (exit 2); a VAE config without latents_mean is refused too."""
    import json
    import shutil

    from transformers import Qwen2Tokenizer

    from tests.helpers.tiny_diffusers import QWEN_SPECIALS, _byte_symbols

    folder = shutil.copytree(root / "qwenimage", tmp_path / "qwenimage")
    shutil.rmtree(folder / "tokenizer")
    vocab = {s: i for i, s in enumerate([*_byte_symbols(), *QWEN_SPECIALS])}
    bytewise = Qwen2Tokenizer(vocab=vocab, merges=[], extra_special_tokens=list(QWEN_SPECIALS[1:]))
    bytewise.save_pretrained(folder / "tokenizer")
    line = validate_refusal(tmp_path, "qwenimage", folder, root / "data")
    assert "pipeline.pretrained" in line and "drops 34" in line

    vae = json.loads((folder / "vae" / "config.json").read_text())
    del vae["latents_mean"]
    (folder / "vae" / "config.json").write_text(json.dumps(vae))
    shutil.rmtree(folder / "tokenizer")
    shutil.copytree(root / "qwenimage" / "tokenizer", folder / "tokenizer")
    with pytest.raises(ConfigError, match="vae/config.json has no latents_mean"):
        make_plan(job(root, "bad-vae", pipeline={"pretrained": str(folder)}))
