"""The diffusers families end to end on tiny Hub-style folders, with real diffusers classes.

Per family: plan -> preprocess -> split training (real torchrun, gloo) -> export; the family's
diffusers pipeline, built from the same folder, loads the exported LoRA (diffusers layout, and the
kohya layout where diffusers reads it) and reproduces the trained denoiser, which is rebuilt
independently from the run's last DCP checkpoint; unsplit training gives the same losses.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from splitstage.config.job import config_from_dict
from splitstage.data.dataset import load_metadata
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.checkpoint import latest_checkpoint, load_checkpoint
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
FAMILY = {"sd": "sd", "sd2": "sd", "sdxl": "sdxl", "sd3": "sd3", "flux": "flux"}
DENOISER = {"sd": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer"}
PIPELINE = {
    "sd": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
}
KOHYA_LOADS = {"sd", "sdxl", "flux"}  # diffusers 0.42 has no converter for SD3 kohya files
ONE_CPU = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")
SAMPLED = {"validation": {"prompts": ["a handwritten digit seven"], "steps": 2}}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A captioned data set (8 digits) and one tiny folder per kind."""
    root = tmp_path_factory.mktemp("families")
    write_digits_dataset(root / "data", limit=8, size=32)
    for kind in FAMILY:
        write_tiny_folder(kind, root / kind)
    return root


def job(root: Path, kind: str, name: str, *, models=None, trainable=None, validation=None, **train):
    """A LoRA job (rank 4, alpha 8: the scale is not 1) on `kind`'s folder at 64 px."""
    family = FAMILY[kind]
    pipeline = {"name": family, "pretrained": str(root / kind), "resolution": 64}
    pipeline |= {"caption_dropout": 0.25, "precision": "fp32"}
    if family in ("sd3", "flux"):
        pipeline["max_prompt_length"] = 16
    return config_from_dict(
        {
            "job": {"name": name, "seed": 3},
            "pipeline": pipeline,
            "models": models or {},
            "trainable": trainable
            or {"lora_base_model": DENOISER[family], "lora_rank": 4, "lora_alpha": 8},
            "data": {"base_path": str(root / "data")},
            "cache": {"url": str(root / "cache"), "shard_samples": 4},
            "train": {"batch_size": 4, "max_steps": 2, "log_every": 1, "learning_rate": 1e-3}
            | train,
            "output": {"url": str(root / "out")},
            "validation": validation or {},
        }
    )


def run(config, root: Path):
    """Train through the real launcher (torchrun, one gloo rank)."""
    return train(config, run_root=root / "runs", env=ENV, on_line=lambda line: None)


def trained_from_checkpoint(config, report):
    """The denoiser as the run left it: meta build, LoRA, load, then its last DCP checkpoint."""
    plan = make_plan(config)
    stage2 = build_stage2_models(plan, ONE_CPU)
    step = latest_checkpoint(report.checkpoint_url, clean=False)
    trained = stage2.trained[0]
    load_checkpoint(report.checkpoint_url, step, stage2.models[trained], None, restore_rng=False)
    return plan, stage2.models[trained]


def fixed_step(plan, config, denoiser):
    """A batch through stage 1 and the per-step units, and one drawn training step."""
    family = plan.family
    base = config.data.base_path
    batch = collate_samples([family.load_sample(r, base) for r in load_metadata(base)[:2]])
    frozen = {
        name: family.build_model(name, ONE_CPU.device) for name in plan.split.models["stage1"]
    }
    settings = family.settings()
    run_units(plan.v2_units, StepContext(frozen, ONE_CPU.device, settings=settings), batch)
    models = {family.denoiser: denoiser}
    draws = Draws.shared(torch.Generator().manual_seed(5))
    ctx = StepContext(models, ONE_CPU.device, draws, settings)
    run_units(plan.v1_units, ctx, batch)
    return family.training_step(ctx, batch)


def predict(plan, denoiser, step) -> torch.Tensor:
    """The family's denoiser call on a step, with `denoiser` as the model."""
    ctx = StepContext({plan.family.denoiser: denoiser}, ONE_CPU.device)
    with torch.no_grad():
        return plan.family.denoise(ctx, step)


def fresh_pipeline(kind: str, root: Path):
    """The kind's diffusers pipeline from the same folder (offline)."""
    import diffusers

    return getattr(diffusers, PIPELINE[FAMILY[kind]]).from_pretrained(root / kind)


@pytest.mark.parametrize("kind", list(FAMILY))
def test_split_training_exports_a_lora_the_diffusers_pipeline_reproduces(root, kind):
    config = job(root, kind, f"{kind}-split")
    plan = make_plan(config)
    family = FAMILY[kind]
    assert set(plan.split.v2) >= {"PromptEncoder", "VAEEncoder"}
    assert list(plan.split.v1) == ["LatentSampler", "CaptionDropout"]  # fresh every step
    assert {"latent_mean", "latent_logvar"} <= set(plan.split.boundary_params)
    assert plan.split.models["stage2"] == (DENOISER[family],)

    first = preprocess(config, workers=1, progress=False)
    assert first.computed == 8
    report = run(config, root)
    assert report.updates == 2 and all(math.isfinite(loss) for loss in report.losses)
    assert report.models_loaded == [DENOISER[family]]  # only the denoiser in stage 2
    denoiser = DENOISER[family]
    lora_file = Path(report.outputs[denoiser])
    assert lora_file.name == "pytorch_lora_weights.safetensors"
    with safe_open(str(lora_file), "pt") as handle:
        assert json.loads(handle.metadata()["lora_adapter_metadata"])[f"{denoiser}.lora_alpha"] == 8
        assert all(k.startswith(f"{denoiser}.") for k in handle.keys())  # noqa: SIM118

    unsplit = run(job(root, kind, f"{kind}-unsplit", mode="unsplit"), root)
    assert unsplit.losses == pytest.approx(report.losses, rel=1e-5)
    assert sorted(unsplit.models_loaded) == sorted(plan.family.model_names)

    plan, trained = trained_from_checkpoint(config, report)
    step = fixed_step(plan, config, trained)
    expected = predict(plan, trained, step)
    pipe = fresh_pipeline(kind, root)
    base = predict(plan, getattr(pipe, denoiser), step)
    assert not torch.allclose(base, expected, atol=1e-6)  # the LoRA learned something
    pipe.load_lora_weights(lora_file.parent)
    assert torch.allclose(predict(plan, getattr(pipe, denoiser), step), expected, atol=2e-5)

    kohya = Path(report.outputs[f"{denoiser}_kohya"])
    with safe_open(str(kohya), "pt") as handle:
        meta = handle.metadata()
    assert (meta["ss_network_dim"], meta["ss_network_alpha"], meta["ss_steps"]) == ("4", "8.0", "2")
    if family in KOHYA_LOADS:
        pipe = fresh_pipeline(kind, root)
        pipe.load_lora_weights(str(kohya))
        assert torch.allclose(predict(plan, getattr(pipe, denoiser), step), expected, atol=2e-5)


def test_a_sharded_override_of_the_denoiser_loads_the_same_weights(root):
    sharded = write_tiny_folder("flux", root / "flux-sharded", max_shard_size="40KB")
    index = sharded / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    assert index.is_file() and len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    plain = job(root, "flux", "flux-plain")
    override = job(root, "flux", "flux-override", models={"transformer": {"weights": str(index)}})
    # The cache key fingerprints content: the shards hold the same tensors as the one file,
    # but in other files, so stage 1 (which never reads the transformer) shares the cache.
    assert make_plan(override).cache_key == make_plan(plain).cache_key
    preprocess(plain, workers=1, progress=False)
    assert run(override, root).losses == run(plain, root).losses


def test_full_fine_tuning_exports_a_component_folder_and_an_original_file(root):
    from diffusers import SD3Transformer2DModel

    config = job(root, "sd3", "sd3-full", trainable={"full": ["transformer"]}, max_steps=1)
    preprocess(config, workers=1, progress=False)
    report = run(config, root)
    out = Path(report.output_url)
    assert Path(report.outputs["transformer"]).name == "config.json"
    loaded = SD3Transformer2DModel.from_pretrained(out, subfolder="transformer")
    _, trained = trained_from_checkpoint(config, report)
    original = SD3Transformer2DModel.from_pretrained(root / "sd3", subfolder="transformer")
    want = trained.state_dict()
    assert set(loaded.state_dict()) == set(want)
    assert all(torch.equal(t, want[k]) for k, t in loaded.state_dict().items())
    assert any(not torch.equal(t, want[k]) for k, t in original.state_dict().items())
    # and the original SD3 layout beside it, as diffusers' from_single_file reads it
    single = Path(report.outputs["transformer_original"])
    assert single == out / "transformer_original.safetensors"
    read = SD3Transformer2DModel.from_single_file(
        str(single), config=str(root / "sd3"), subfolder="transformer", local_files_only=True
    )
    assert all(torch.equal(t, want[k]) for k, t in read.state_dict().items())


def test_training_the_text_encoder_moves_its_unit_to_stage_2(root):
    config = job(root, "sd", "sd-te", trainable={"lora_base_model": "text_encoder", "lora_rank": 2})
    plan = make_plan(config)
    assert "PromptEncoder" in plan.split.v1 and "VAEEncoder" in plan.split.v2
    assert set(plan.split.models["stage2"]) == {"text_encoder", "unet"}
    preprocess(config, workers=1, progress=False)
    report = run(config, root)
    assert report.updates == 2 and all(math.isfinite(loss) for loss in report.losses)
    exported = load_file(report.outputs["text_encoder"])
    assert exported and all(k.startswith("text_encoder.") for k in exported)
    pipe = fresh_pipeline("sd", root)
    pipe.load_lora_weights(Path(report.outputs["text_encoder"]).parent)  # loads without error


@pytest.mark.parametrize(("kind", "t5"), [("flux", "text_encoder_2"), ("sd3", "text_encoder_3")])
def test_a_t5_lora_exports_a_peft_folder_not_a_file_the_pipeline_drops(root, kind, t5):
    """The pipelines' load_lora_weights load no T5 LoRA (it would be skipped, unsaid): the
    T5's LoRA is a PEFT adapter folder that PeftModel.from_pretrained loads into the pipeline's
    T5, which then encodes as the trained one does."""
    from peft import PeftModel

    trainable = {"lora_base_model": t5, "lora_rank": 2, "lora_alpha": 4}
    config = job(root, kind, f"{kind}-t5", trainable=trainable)
    config.output.url = str(root / f"out-{kind}-t5")
    preprocess(config, workers=1, progress=False)
    report = run(config, root)
    assert report.updates == 2 and all(math.isfinite(loss) for loss in report.losses)
    folder = Path(report.outputs[t5]).parent
    assert folder.name == t5 and (folder / "adapter_config.json").is_file()
    assert not (root / f"out-{kind}-t5" / "pytorch_lora_weights.safetensors").exists()
    ids = torch.tensor([[5, 6, 7, 1]])
    pipe = fresh_pipeline(kind, root)
    encoder = getattr(pipe, t5).eval()
    with torch.no_grad():
        base = encoder(ids)[0]
        loaded = PeftModel.from_pretrained(encoder, str(folder)).eval()(ids)[0]
    assert (loaded - base).abs().max() > 0  # two updates at lr 1e-3 moved the T5's LoRA


def torchrun(nproc: int, config_path: Path, out: Path) -> None:
    """The FSDP worker under real torchrun (gloo)."""
    out.mkdir(parents=True, exist_ok=True)
    worker = Path(__file__).parent / "workers" / "family_fsdp_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    command += ["--standalone", str(worker), str(config_path), str(out)]
    env = {**os.environ, **ENV}
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a hung rank dies with its launcher (the whole group)
    ) as proc:  # fmt: skip
        try:
            _, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(root, tmp_path_factory):
    """Per family, the worker's losses and adapters in one process (computed once)."""
    results = {}

    folders = {}

    def get(kind: str):
        if kind not in results:
            out = folders[kind] = tmp_path_factory.mktemp(f"{kind}-one")
            path = out / "config.json"
            path.write_text(job(root, kind, f"{kind}-one", **SAMPLED).model_dump_json())
            torchrun(1, path, out)
            results[kind] = worker_result(out)
        return results[kind]

    get.folder = folders.__getitem__
    return get


def grid_pixels(out: Path) -> np.ndarray:
    """The worker's validation grid as an RGB array."""
    return np.asarray(Image.open(out / "samples" / "update-000003.png").convert("RGB"))


def worker_result(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Rank 0's losses and gathered adapter tensors."""
    losses = json.loads((out / "result-rank0.json").read_text())["losses"]
    return losses, load_file(out / "lora-rank0.safetensors")


@pytest.mark.parametrize(("kind", "parallelism"), [("flux", "fsdp"), ("flux", "tp"), ("sd3", "tp")])
def test_two_ranks_equal_one_process(root, tmp_path, one_process, kind, parallelism):
    # TP shards the joint blocks' attention by heads: each rank's attention must see heads / 2.
    train = {"parallelism": parallelism, "nproc_per_node": 2}
    if parallelism == "tp":
        train["tp_degree"] = 2
    path = tmp_path / "config.json"
    path.write_text(job(root, kind, f"{kind}-{parallelism}", **train, **SAMPLED).model_dump_json())
    torchrun(2, path, tmp_path)
    losses, adapters = worker_result(tmp_path)
    want_losses, want = one_process(kind)
    # Validation sampling on 2 ranks draws the 1-process images (to 1/255: float noise).
    grids = [grid_pixels(folder) for folder in (tmp_path, one_process.folder(kind))]
    assert grids[0].shape == grids[1].shape
    assert np.abs(grids[0].astype(int) - grids[1].astype(int)).max() <= 1
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    assert set(adapters) == set(want) and len(want) > 0
    for key in want:
        torch.testing.assert_close(adapters[key], want[key], rtol=1e-4, atol=1.5e-5)
