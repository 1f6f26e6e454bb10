"""Tiny diffusers folders load offline with their real pipeline classes and run end to end."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_diffusers
from tests.helpers.tiny_diffusers import KINDS, write_tiny_folder

PIPELINES = {
    "sd": "StableDiffusionPipeline",
    "sd2": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
}
# kind -> (latent channels, scaling_factor, shift_factor, denoiser folder)
VAE = {
    "sd": (4, 0.18215, None, "unet"),
    "sd2": (4, 0.18215, None, "unet"),
    "sdxl": (4, 0.13025, None, "unet"),
    "sd3": (16, 1.5305, 0.0609, "transformer"),
    "flux": (16, 0.3611, 0.1159, "transformer"),
}
# kind -> [(tokenizer folder, text encoder folder, model_max_length)]
TOKENIZERS = {
    "sd": [("tokenizer", "text_encoder", 77)],
    "sd2": [("tokenizer", "text_encoder", 77)],
    "sdxl": [("tokenizer", "text_encoder", 77), ("tokenizer_2", "text_encoder_2", 77)],
    "sd3": [
        ("tokenizer", "text_encoder", 77),
        ("tokenizer_2", "text_encoder_2", 77),
        ("tokenizer_3", "text_encoder_3", 512),
    ],
    "flux": [("tokenizer", "text_encoder", 77), ("tokenizer_2", "text_encoder_2", 512)],
}
PROMPT = "a photo of the digit 3"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """One torch thread; HF_HUB_OFFLINE=1 and any socket connect fails the test."""
    import huggingface_hub.constants

    def no_network(*args, **kwargs):
        raise AssertionError("tried to use the network")

    torch.set_num_threads(1)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket.socket, "connect", no_network)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Every kind written once (seed 0) for this module."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: write_tiny_folder(kind, root / kind) for kind in KINDS}


def load(kind: str, folder: Path):
    """The folder through its real diffusers pipeline class."""
    import diffusers

    extra = (
        {"safety_checker": None, "requires_safety_checker": False} if kind in ("sd", "sd2") else {}
    )
    return getattr(diffusers, PIPELINES[kind]).from_pretrained(folder, **extra)


def run(kind: str, pipe) -> torch.Tensor:
    """Two denoising steps at 64x64, latents out."""
    extra = {"max_sequence_length": 32} if kind in ("sd3", "flux") else {}
    generator = torch.Generator().manual_seed(0)
    out = pipe(
        PROMPT,
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="latent",
        generator=generator,
        **extra,
    )
    return out.images


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.parametrize("kind", KINDS)
def test_folder_loads_and_runs(folders, kind):
    folder = folders[kind]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINES[kind]
    channels, scaling, shift, denoiser = VAE[kind]
    assert (folder / denoiser / "diffusion_pytorch_model.safetensors").is_file()
    assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) < 10_000_000
    pipe = load(kind, folder)
    vae = pipe.vae.config
    assert (vae.latent_channels, vae.scaling_factor, vae.shift_factor) == (channels, scaling, shift)
    assert 2 ** (len(vae.block_out_channels) - 1) == 8
    latents = run(kind, pipe)
    packed = (1, 16, 4 * channels) if kind == "flux" else (1, channels, 8, 8)  # FLUX packs 2x2
    assert latents.shape == packed and torch.isfinite(latents).all()


def test_family_specifics(folders):
    def config(kind: str, sub: str) -> dict:
        name = "scheduler_config.json" if sub == "scheduler" else "config.json"
        return json.loads((folders[kind] / sub / name).read_text())

    assert config("sd", "scheduler")["prediction_type"] == "epsilon"
    assert config("sd2", "scheduler")["prediction_type"] == "v_prediction"
    assert config("sd2", "unet")["use_linear_projection"] is True
    xl = config("sdxl", "unet")
    te1, te2 = config("sdxl", "text_encoder"), config("sdxl", "text_encoder_2")
    assert xl["cross_attention_dim"] == te1["hidden_size"] + te2["hidden_size"]
    assert xl["projection_class_embeddings_input_dim"] == 6 * 8 + te2["projection_dim"]
    assert json.loads((folders["sdxl"] / "model_index.json").read_text())[
        "force_zeros_for_empty_prompt"
    ]
    sd3 = config("sd3", "transformer")
    assert sd3["joint_attention_dim"] == config("sd3", "text_encoder_3")["d_model"]
    assert sd3["pooled_projection_dim"] == sum(
        config("sd3", f)["projection_dim"] for f in ("text_encoder", "text_encoder_2")
    )
    assert config("sd3", "scheduler")["shift"] == 3.0
    flux = config("flux", "transformer")
    assert flux["in_channels"] == 4 * config("flux", "vae")["latent_channels"]
    assert sum(flux["axes_dims_rope"]) == flux["attention_head_dim"] and flux["guidance_embeds"]
    assert config("flux", "scheduler")["use_dynamic_shifting"] is True


@pytest.mark.parametrize("kind", KINDS)
def test_tokenizers_fit_their_text_encoders(folders, kind):
    import transformers
    from transformers import AutoConfig

    index = json.loads((folders[kind] / "model_index.json").read_text())
    for tok_dir, model_dir, max_length in TOKENIZERS[kind]:
        library, class_name = index[tok_dir]  # CLIPTokenizer or T5Tokenizer, as the pipeline loads
        assert library == "transformers"
        tokenizer = getattr(transformers, class_name).from_pretrained(folders[kind] / tok_dir)
        vocab_size = AutoConfig.from_pretrained(folders[kind] / model_dir).vocab_size
        assert len(tokenizer) == vocab_size and tokenizer.model_max_length == max_length
        ids = tokenizer([PROMPT, "Hello, World! 0123456789 é"]).input_ids
        assert all(0 <= i < vocab_size for row in ids for i in row)
        if tokenizer.unk_token_id != tokenizer.eos_token_id:  # CLIP: unk is eos, as real ones
            assert tokenizer.unk_token_id not in ids[0]  # the training prompts need no <unk>
        assert ids[0][-1] == tokenizer.eos_token_id


def test_same_seed_same_bytes_other_seed_other_weights(folders, tmp_path):
    again = digests(write_tiny_folder("flux", tmp_path / "again", seed=0))
    assert again == digests(folders["flux"])
    other = digests(write_tiny_folder("flux", tmp_path / "other", seed=1))
    weights = [name for name in again if name.endswith(".safetensors")]
    assert weights and all(other[name] != again[name] for name in weights)


@pytest.mark.parametrize("kind", ["sdxl", "sd3"])
def test_sharded_denoiser(folders, tmp_path, kind):
    folder = write_tiny_folder(kind, tmp_path / kind, max_shard_size="200KB")
    denoiser = folder / VAE[kind][3]
    assert (denoiser / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert not (denoiser / "diffusion_pytorch_model.safetensors").exists()
    assert len(list(denoiser.glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    assert (folder / "vae" / "diffusion_pytorch_model.safetensors").is_file()  # others whole
    sharded, whole = load(kind, folder), load(kind, folders[kind])
    a, b = sharded.components[VAE[kind][3]], whole.components[VAE[kind][3]]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    write_tiny_folder(kind, folder)  # rewriting unsharded leaves no stale index behind
    assert sorted(p.name for p in denoiser.iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
    ]


def test_main_writes_and_prints(tmp_path, capsys):
    tiny_diffusers.main(["sd3", str(tmp_path / "cli"), "--seed", "2"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model_index.json").is_file()


def test_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="unknown kind"):
        write_tiny_folder("sd4", tmp_path)
