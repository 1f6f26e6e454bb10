"""A tiny stage-2 job shared by the training tests: digits subset, demo weights, tiny encoder."""

from __future__ import annotations

from pathlib import Path

from splitstage.config.job import SplitstageConfig, config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.demo.weight_files import build_demo_weights
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.outputs import run_places
from splitstage.tasks.stage2.rank_setup import set_up_rank
from splitstage.tasks.stage2.run_spec import SPEC_FILE, RankSetup, RunSpec


def tiny_config(root: Path, name: str, seed: int, **train) -> SplitstageConfig:
    """LoRA (rank 4) on the demo DiT; `train` overrides [train] fields."""
    return config_from_dict(
        {
            "job": {"name": name, "seed": seed},
            "models": {
                "vae": {"weights": str(root / "weights/vae.safetensors")},
                "dit": {"weights": str(root / "weights/dit.safetensors")},
                "text_encoder": {"builder": "tiny"},
            },
            "trainable": {"lora_base_model": "dit", "lora_rank": 4},
            "data": {"base_path": str(root / "data")},
            "cache": {"url": str(root / "cache"), "shard_samples": 16},
            "preprocess": {"batch_size": 8},
            "train": {"batch_size": 4, "max_steps": 3, "log_every": 1, "checkpoint_every": 2}
            | train,
            "output": {"url": str(root / "out"), "remove_prefix_in_ckpt": "pipe.dit."},
        }
    )


def make_workspace(root: Path, samples: int, seed: int) -> Path:
    """Write the data set and weights under `root` and fill the cache once."""
    write_digits_dataset(root / "data", limit=samples)
    build_demo_weights(root / "weights")
    preprocess(tiny_config(root, "prep", seed), workers=1, progress=False)
    return root


def one_rank_setup(config: SplitstageConfig, run_root: Path) -> RankSetup:
    """A rank's set-up for `config` in this process (a one-rank group, as without torchrun),
    from the run spec the launcher would write; close the group with `close_distributed`."""
    places = run_places(config, config.job.name, run_root)
    spec = RunSpec(config=config, run_id=config.job.name, places=places)
    spec.write(Path(places.run_dir) / SPEC_FILE)
    return set_up_rank(spec)
