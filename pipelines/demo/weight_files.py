"""The demo's weights files: safetensors with the architecture in the metadata (no pickle)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from torch import nn

from splitstage.pipelines.demo.autoencoder_training import trained_autoencoder
from splitstage.pipelines.demo.dit import DiT
from splitstage.pipelines.demo.vae import VAEDecoder
from splitstage.storage.safetensors_io import canonical


def save_weights(
    model: nn.Module, path: str | Path, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write the model's state dict to a safetensors file, with its `config` in the metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    meta = {"format": "pt", "class": type(model).__name__}
    if hasattr(model, "config"):
        meta["config"] = json.dumps(model.config, sort_keys=True)
    meta.update(metadata or {})
    raw = save(tensors, metadata=meta)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(canonical(raw))
    tmp.replace(path)
    return path


def load_weights(model: nn.Module, path: str | Path, strict: bool = True) -> nn.Module:
    """Copy tensors from a safetensors file into the model's (already materialized) parameters."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist; run build_demo_weights")
    if any(t.is_meta for t in model.state_dict().values()):
        raise ValueError(f"{type(model).__name__} is on the meta device; call to_empty() first")
    state = load_file(str(path))
    own = model.state_dict()
    for name, tensor in state.items():
        if name in own and own[name].shape != tensor.shape:
            raise ValueError(
                f"{path} does not match {type(model).__name__}: {name} is "
                f"{tuple(tensor.shape)} in the file, {tuple(own[name].shape)} in the model; was "
                "it written for another config?"
            )
    result = model.load_state_dict(state, strict=False)
    if strict and (result.missing_keys or result.unexpected_keys):
        raise ValueError(
            f"{path} does not match {type(model).__name__}: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}; was it written for another config?"
        )
    return model


def weights_config(path: str | Path) -> dict:
    """The model config saved in a safetensors file's metadata by save_weights ({} if none)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta.get("config", "{}"))


def load_decoder(path: str | Path, device: torch.device | str = "cpu") -> VAEDecoder:
    """The VAEDecoder in a vae_decoder.safetensors file (built from its config), in eval mode."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist; run build_demo_weights")
    decoder = VAEDecoder(**weights_config(path))
    load_weights(decoder, path)
    return decoder.to(device).eval().requires_grad_(False)


def build_demo_weights(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write vae.safetensors (encoder), vae_decoder.safetensors and dit.safetensors.

    The VAE is trained on the digits here (a few seconds, once a process: see
    autoencoder_training), so latents mean something and samples decode; the DiT is a fixed
    seeded init standing in for pretrained weights (the demo trains it). Same seed, same bytes.
    """
    out_dir = Path(out_dir)
    trained = trained_autoencoder(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        dit = DiT()
    meta = {"seed": str(seed)}
    vae_meta = {**meta, "heldout_mse": f"{trained.report.heldout_mse:.6g}"}
    return {
        "vae": save_weights(trained.encoder, out_dir / "vae.safetensors", vae_meta),
        "vae_decoder": save_weights(trained.decoder, out_dir / "vae_decoder.safetensors", vae_meta),
        "dit": save_weights(dit, out_dir / "dit.safetensors", meta),
    }
