"""Wan 2.1 through diffusers (`[pipeline] name = "wan"`) on a tiny Hub-style folder with the real
classes (WanTransformer3DModel, AutoencoderKLWan, UMT5EncoderModel, UniPC) and a data set of real
short video files written with PyAV: the split plan and its cache key, our training loss against
the diffusers computation for the same noise and timesteps (and a Wan 2.2 expert's, whose LoRA
loads into transformer_2), the sampler against WanPipeline, and plan -> preprocess -> torchrun
training (split on 2 TP ranks = unsplit on 1) -> an export WanPipeline.load_lora_weights
reproduces, with validation clips written as animated WebP.
Run: .venv/bin/pytest -m slow tests/integration/test_wan.py
"""

from __future__ import annotations

import io
import json
import math
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("av")

from splitstage.config.job import ConfigError  # noqa: E402
from splitstage.data.dataset import load_metadata  # noqa: E402
from splitstage.data.index import index_data_set  # noqa: E402
from splitstage.pipelines.draws import Draws  # noqa: E402
from splitstage.pipelines.runtime import StepContext  # noqa: E402
from splitstage.tasks.job_plan import make_plan, open_cache  # noqa: E402
from splitstage.tasks.stage1.preprocess import preprocess  # noqa: E402
from splitstage.tasks.stage2.parallelize import find_blocks  # noqa: E402
from splitstage.tasks.stage2.preflight import preflight  # noqa: E402
from tests.helpers.diffusers_families import (  # noqa: E402
    CPU,
    assert_exports_reproduce,
    assert_loras_load,
    assert_the_encoders_are_cached,
    drawn_step,
    lora_job,
    predict,
    run,
    sampled,
    tiny_pipeline,
)
from tests.helpers.stage2_step import seed_adapters, trained_model  # noqa: E402
from tests.helpers.tiny_diffusers import write_tiny_folder  # noqa: E402
from tests.helpers.video_files import write_video  # noqa: E402
from tests.helpers.wandb_records import history  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of the digit 3", "a cat"]
LENGTH = 24  # max_prompt_length: longer than both prompts, so the embeddings are zero-padded
FRAMES = 5  # 4k+1: two latent frames
SIDE = 64


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Four short real videos (PyAV, h264) and two images (one-frame clips) captioned in
    metadata.jsonl, and the tiny Wan folder."""
    from PIL import Image

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("wan")
    rows = []
    for index in range(4):
        name = f"clips/clip{index}.mp4"
        write_video(root / "data" / name, 12 + 3 * index, rate=8 + index)
        rows.append({"video": name, "prompt": f"clip {index} of moving squares"})
    for index in range(2):
        pixels = torch.rand(48, 64, 3, generator=torch.Generator().manual_seed(index))
        Image.fromarray((pixels * 255).byte().numpy()).save(root / "data" / f"still{index}.png")
        rows.append({"image": f"still{index}.png", "prompt": f"a still {index}"})
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    (root / "data" / "metadata.jsonl").write_text(lines)
    write_tiny_folder("wan", root / "wan")
    write_tiny_folder("wan22", root / "wan22")
    return root


def job(
    root: Path,
    name: str,
    *,
    pipeline=None,
    video=None,
    validation=None,
    lora=None,
    data=None,
    cache=None,
    **train,
):
    """A LoRA job on the tiny folder (see lora_job): SIDE px, 5-frame clips, prompts LENGTH
    tokens at most."""
    pipeline = {"resolution": SIDE, "max_prompt_length": LENGTH} | (pipeline or {})
    data = {"video": {"num_frames": FRAMES, "frame_stride": 2} | (video or {})} | (data or {})
    return lora_job(
        root,
        "wan",
        name,
        pipeline=pipeline,
        data=data,
        cache=cache,
        lora=lora or "transformer",
        validation=validation or {},
        **train,
    )


def pipeline(root: Path, folder: str = "wan"):
    """WanPipeline from the same folder (offline)."""
    return tiny_pipeline(root, "WanPipeline", folder)


def test_the_plan_caches_prompts_and_clip_latents_and_keys_the_frame_settings(root):
    plan = make_plan(job(root, "plan"))
    assert_the_encoders_are_cached(plan, {"prompt_embeds", "empty_prompt_embeds"})
    # frame settings and stage-1 pipeline settings change the cache key; per-step ones do not
    for changed in (
        job(root, "plan", video={"num_frames": FRAMES + 4}),
        job(root, "plan", video={"frame_stride": 1}),
        job(root, "plan", video={"fps": 4.0, "frame_stride": None}),
        job(root, "plan", pipeline={"max_prompt_length": LENGTH + 1}),
    ):
        assert make_plan(changed).cache_key != plan.cache_key
    per_step = {"flow_shift": 5.0, "caption_dropout": 0.5, "weighting_scheme": "logit_normal"}
    assert make_plan(job(root, "plan", pipeline=per_step)).cache_key == plan.cache_key
    sample = plan.family.load_sample(load_metadata(root / "data")[0], root / "data")
    assert sample["video"].shape == (FRAMES, 3, SIDE, SIDE)


def test_shorten_puts_short_clips_in_frame_buckets_cached_and_counted_apart(root):
    """short_clips = 'shorten' at 9 frames, stride 2: the 6- and 8-frame clips train at 5 frames,
    the 9- and 11-frame ones at 9, the images at 1; each frame count is its own cache group
    (1, 2 and 3 latent frames), counted apart in the cache's stats as stage 2 batches them."""
    config = job(root, "frames", video={"num_frames": 9, "short_clips": "shorten"})
    plan = make_plan(config)
    assert plan.cache_key != make_plan(job(root, "frames", video={"num_frames": 9})).cache_key
    rows = load_metadata(root / "data")
    frames = [plan.family.load_sample(row, root / "data")["video"].shape[0] for row in rows]
    assert frames == [5, 5, 9, 9, 1, 1]
    assert preprocess(config, workers=1, progress=False).computed == 6
    groups = open_cache(plan).stats().buckets
    notes = preflight(plan).notes  # what validate and train say: info, not a buckets warning
    assert "batches hold samples of one shape: 3 shapes" in notes
    assert not any("bucket" in note for note in notes)
    assert sorted(groups.values()) == [2, 2, 2]
    latent_frames = sorted(label.split("latent_mean 4x")[1][0] for label in groups)
    assert latent_frames == ["1", "2", "3"], groups


def test_unsplit_batches_group_clips_of_other_lengths_even_when_every_row_is_a_video(
    root, tmp_path
):
    """Training without a cache decodes each batch: with short_clips = 'shorten' the 6- and
    8-frame clips give 5 frames beside the others' 9, though every row names a video, so the
    raw batches group by shape (as the cache does) instead of collating 5 with 9 frames."""
    from splitstage.tasks.stage2.batches import RawBatches

    data = tmp_path / "clips-only"
    shutil.copytree(root / "data" / "clips", data / "clips")
    rows = [{"video": f"clips/clip{i}.mp4", "prompt": f"clip {i}"} for i in range(4)]
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = job(
        root,
        "raw",
        video={"num_frames": 9, "short_clips": "shorten"},
        data={"base_path": str(data)},
        mode="unsplit",
    )
    batches = RawBatches(make_plan(config).family, rank=0, world_size=1)
    assert sorted(batches.group_labels().values()) == [2, 2]
    for _, batch in batches.iterate(0):
        assert len({clip.shape for clip in batch["video"]}) == 1


def diffusers_loss(pipe, transformer, batch) -> torch.Tensor:
    """The step's loss computed with diffusers' components alone: WanPipeline's prompt encoding,
    its VAE's latents normalised as the pipeline undoes them, sigma from
    FlowMatchEulerDiscreteScheduler with the folder's flow_shift, target noise - latents."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    with torch.no_grad():
        embeds = pipe._get_t5_prompt_embeds(PROMPTS, max_sequence_length=LENGTH)
        clips = batch["video"].permute(0, 2, 1, 3, 4)  # [B, 3, F, H, W]
        z = pipe.vae.encode(clips).latent_dist.mode()
    assert z.shape == (2, 4, 2, SIDE // 8, SIDE // 8)  # (5 - 1) / 4 + 1 latent frames
    assert (embeds[1, 8:] == 0).all()  # the shorter prompt's padding is zeros, as cached
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)
    model_input = (z - mean) * inv_std
    scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    timesteps = batch["timestep"]
    index = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[index].view(-1, 1, 1, 1, 1)
    noise = batch["noise"]
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    with torch.no_grad():
        pred = transformer(
            hidden_states=noisy,
            timestep=timesteps,
            encoder_hidden_states=embeds,
            return_dict=False,
        )[0]
    return torch.mean((pred - (noise - model_input)) ** 2)


def test_the_training_loss_is_the_diffusers_computation(root):
    """Same noise and timesteps (flow_shift 3 from the folder's UniPC config)."""
    plan = make_plan(job(root, "loss", pipeline={"vae_latents": "mean"}))
    family = plan.family
    pipe = pipeline(root)
    assert pipe.scheduler.config.flow_shift == 3.0
    batch, ctx, step = drawn_step(plan, pipe.transformer, PROMPTS)
    with torch.no_grad():
        ours = family.loss(family.denoise(ctx, step), step)
    assert ours.item() == pytest.approx(
        diffusers_loss(pipe, pipe.transformer, batch).item(), rel=1e-5
    )


def ours(plan, seed: int) -> torch.Tensor:
    """Our sampler + clip decoder on the folder's frozen models: clips [B, F, 3, H, W] in [0, 1]."""
    return sampled(plan, PROMPTS, seed, clips=True)


def test_the_sampler_matches_the_wan_pipeline(root):
    plan = make_plan(job(root, "sample"))
    mine = ours(plan, seed=4)
    assert mine.shape == (2, FRAMES, 3, SIDE, SIDE)
    assert not torch.equal(mine, ours(plan, seed=5))
    generator = torch.Generator().manual_seed(4)
    noise = torch.randn(2, 4, 2, SIDE // 8, SIDE // 8, generator=generator)
    theirs = pipeline(root)(
        prompt=PROMPTS,
        negative_prompt=["", ""],
        guidance_scale=plan.family.default_guidance,
        latents=noise,
        num_inference_steps=3,
        height=SIDE,
        width=SIDE,
        num_frames=FRAMES,
        max_sequence_length=LENGTH,
        output_type="pt",
    ).frames
    torch.testing.assert_close(mine, theirs, atol=5e-5, rtol=0)


def test_checkpointing_gives_the_same_loss_and_gradients_and_recomputes_each_block(root):
    """The family's hook (the transformer's own switch) on the real stage-2 build."""
    g = torch.Generator().manual_seed(0)
    inputs = {
        "input_latents": torch.randn(2, 4, 2, 8, 8, generator=g),
        "prompt_embeds": torch.randn(2, LENGTH, 32, generator=g),
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


def test_wan_22_trains_one_chosen_expert_on_its_timesteps_and_refuses_otherwise(root, tmp_path):
    """A Wan 2.2 A14B folder (transformer + transformer_2, boundary_ratio 0.875): pipeline.expert
    picks the trained transformer and its part of the shifted table; without it, with the other
    component as lora_base_model, with validation prompts, on a Wan 2.1 folder, or on a TI2V
    folder (expand_timesteps), one ConfigError line naming the field."""
    wan22 = {"pretrained": str(root / "wan22"), "vae_latents": "mean"}
    with pytest.raises(ConfigError, match=r"^pipeline\.expert: .*boundary_ratio 0\.875") as error:
        make_plan(job(root, "w22", pipeline=wan22))
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="set trainable.lora_base_model = 'transformer_2'"):
        make_plan(job(root, "w22", pipeline=wan22 | {"expert": "low_noise"}))
    with pytest.raises(ConfigError, match="pipeline.expert = 'high_noise': .* one transformer"):
        make_plan(job(root, "w21", pipeline={"expert": "high_noise"}))
    folder = shutil.copytree(root / "wan", tmp_path / "ti2v")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(index | {"expand_timesteps": True}))
    with pytest.raises(ConfigError, match="expand_timesteps"):
        make_plan(job(root, "ti2v", pipeline={"pretrained": str(folder)}))

    high = make_plan(job(root, "w22", pipeline=wan22 | {"expert": "high_noise"}))
    assert high.split.models["stage2"] == ("transformer",)
    assert (high.family.noise_scheduler.timesteps >= 875).all()
    plan = make_plan(
        job(root, "w22", pipeline=wan22 | {"expert": "low_noise"}, lora="transformer_2")
    )
    family = plan.family
    assert plan.split.models["stage2"] == ("transformer_2",)
    table = family.noise_scheduler
    assert (table.timesteps < 875).all() and len(table.timesteps) + len(
        high.family.noise_scheduler.timesteps
    ) == 1000
    with pytest.raises(ConfigError, match="validation.prompts: a Wan 2.2 expert"):
        family.check_sampling()

    # the loss is diffusers' on transformer_2 for the same (low-noise) draws
    pipe = pipeline(root, "wan22")
    batch, ctx, step = drawn_step(plan, pipe.transformer_2, PROMPTS)
    assert (batch["timestep"] < 875).all()
    with torch.no_grad():
        ours = family.loss(family.denoise(ctx, step), step)
    theirs = diffusers_loss(pipe, pipe.transformer_2, batch)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)

    # the low-noise LoRA exports (diffusers' and ComfyUI's names) as WanPipeline loads it into
    # transformer_2
    from splitstage.tasks.stage2.export import request_for
    from splitstage.tasks.stage2.models import LORA_ADAPTER

    _, trained = trained_model(plan.config)
    seed_adapters(trained)
    state = {
        key.replace(f".{LORA_ADAPTER}.", "."): tensor
        for key, tensor in trained.state_dict().items()
        if "lora_" in key
    }
    request = request_for(True, family, steps=1)
    files = family.export_files("transformer_2", state, request)
    assert sorted(files) == ["transformer_2", "transformer_2_comfyui"]
    expected = predict(plan, trained, step)
    loras = []
    for label, (name, data) in files.items():
        (tmp_path / label).mkdir()
        (tmp_path / label / name).write_bytes(data)
        loras.append(tmp_path / label / name)
    load = partial(pipeline, root, "wan22")
    assert_loras_load(plan, step, expected, loras, load, load_into_transformer_2=True)


def test_split_training_through_torchrun_equals_unsplit_and_exports_a_lora_the_pipeline_loads(
    root,
):
    """Videos and images mixed (batches of one frame count each, in both modes); the split run
    is 2 ranks of tensor parallelism (the family's feed-forward plan) against an
    unsplit single rank, so one pair of runs checks split = unsplit and TP = 1 rank; validation
    at the end writes the grid (a 4-frame filmstrip per clip) and each prompt's 5-frame clip as
    an animated WebP; the DCP checkpoint reloads on one rank for the export check."""
    from PIL import Image

    validation = {"prompts": PROMPTS, "steps": 2}
    config = job(
        root,
        "split",
        pipeline={"caption_dropout": 0.5},
        validation=validation,
        parallelism="tp",
        nproc_per_node=2,
        tp_degree=2,
        max_steps=3,
    )
    config.tracking.report_to = ["tensorboard", "wandb"]
    wandb_home = root / "wandb-home"
    wandb_env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_home), "WANDB_SILENT": "true"}
    assert preprocess(config, workers=1, progress=False).computed == 6
    report = run(config, root, wandb_env)
    assert report.updates == 3 and all(math.isfinite(loss) for loss in report.losses)
    assert report.models_loaded == ["transformer"]
    grid = Path(report.samples["3"])
    with Image.open(grid) as image:
        assert image.width == 4 * SIDE  # first .. last frame side by side
    for index in range(len(PROMPTS)):
        with Image.open(grid.with_name(f"{grid.stem}-{index:02d}.webp")) as clip:
            assert clip.is_animated and clip.n_frames == FRAMES and clip.size == (SIDE, SIDE)
    # the trackers get each clip as an animated GIF: TensorBoard's images, W&B's videos
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(report.run_dir) / "tracking" / "split")).Reload()
    clip_tags = [f"samples/clip-{index:02d}" for index in range(len(PROMPTS))]
    assert set(clip_tags) <= set(events.Tags()["images"])
    (shown,) = events.Images(clip_tags[0])
    assert shown.step == 3
    with Image.open(io.BytesIO(shown.encoded_image_string)) as gif:
        assert gif.format == "GIF" and gif.n_frames == FRAMES and gif.size == (SIDE, SIDE)
    (offline,) = (wandb_home / "wandb").glob("offline-run-*/run-*.wandb")
    (row,) = [row for row in history(offline) if clip_tags[0] + "/_type" in row]
    assert row[clip_tags[0] + "/_type"] == "video-file" and row["_step"] == 3
    assert len(list(offline.parent.glob("files/media/videos/samples/*.gif"))) == len(PROMPTS)
    unsplit = job(root, "unsplit", pipeline={"caption_dropout": 0.5}, mode="unsplit", max_steps=3)
    assert run(unsplit, root).losses == pytest.approx(report.losses, rel=1e-5)

    one_rank = job(
        root, "split", pipeline={"caption_dropout": 0.5}, validation=validation, max_steps=3
    )
    outputs = ("transformer", "transformer_comfyui")  # diffusers' layout, the original names
    assert_exports_reproduce(one_rank, report, PROMPTS, outputs, partial(pipeline, root))


def test_clips_in_a_bucket_train_split_as_unsplit_and_export(root, s3_bucket):
    """The same clips and images in a bucket (moto S3 on loopback): the same sample keys and
    cache key as on disk; stage 1 seeks in the block-cached objects and writes its cache to the
    bucket; split training from that cache gives the losses of unsplit training, which decodes
    the clips from the bucket every step; the LoRA exports."""
    import s3fs

    url, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    for path in sorted((root / "data").rglob("*")):
        if path.is_file():
            fs.put(str(path), f"{url}/data/{path.relative_to(root / 'data').as_posix()}")
    endpoint = {"storage_options": {"endpoint_url": options["client_kwargs"]["endpoint_url"]}}
    data = {"base_path": f"{url}/data"} | endpoint
    cache = {"url": f"{url}/cache"} | endpoint

    def on_s3(name: str, **settings):
        return job(root, name, data=data, cache=cache, max_steps=2, **settings)

    split = on_s3("s3-split")
    assert index_data_set(split).keys == index_data_set(job(root, "local")).keys
    assert make_plan(split).cache_key == make_plan(job(root, "local")).cache_key
    assert preprocess(split, workers=1, progress=False).computed == 6
    report = run(split, root)
    assert report.updates == 2 and Path(report.outputs["transformer"]).is_file()
    unsplit = run(on_s3("s3-unsplit", mode="unsplit"), root)
    assert unsplit.losses == pytest.approx(report.losses, rel=1e-5)
