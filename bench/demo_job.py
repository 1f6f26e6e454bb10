"""The job config the stage-2 benchmarks share: LoRA on the demo DiT, real MiniLM encoder."""

from __future__ import annotations

from pathlib import Path

from splitstage.config.job import SplitstageConfig, config_from_dict


def demo_job(work: Path, name: str, samples: int, cache: dict | None = None, **train):
    """A job under `work` (data/, weights/, cache/, out/); `train` overrides [train] fields."""
    config: SplitstageConfig = config_from_dict(
        {
            "job": {"name": name, "seed": 0},
            "models": {
                "vae": {"weights": str(work / "weights/vae.safetensors")},
                "dit": {"weights": str(work / "weights/dit.safetensors")},
                "text_encoder": {"builder": "minilm"},
            },
            "trainable": {"lora_base_model": "dit", "lora_rank": 16},
            "data": {"base_path": str(work / "data"), "limit": samples},
            "cache": {"url": str(work / "cache"), "shard_samples": 128, **(cache or {})},
            "preprocess": {"batch_size": 32},
            "train": {"batch_size": 8, "log_every": 1000, "checkpoint_every": 100000} | train,
            "output": {"url": str(work / "out")},
        }
    )
    return config
