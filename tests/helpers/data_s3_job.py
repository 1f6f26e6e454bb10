"""The demo job on a data set and cache in a bucket, as a dict, shared by the S3 tests."""

from __future__ import annotations

from pathlib import Path


def data_s3_config(root: Path, weights: dict, url: str, endpoint: str | None, **data) -> dict:
    """The job dict: data and cache under `url` (at `endpoint`, if given), output under `root`."""
    endpoint_options = {"endpoint_url": endpoint} if endpoint else {}
    return {
        "job": {"name": "data-s3"},
        "models": {
            "text_encoder": {"builder": "tiny"},
            "vae": {"weights": str(weights["vae"])},
            "dit": {"weights": str(weights["dit"])},
        },
        "trainable": {"full": ["dit"]},
        "data": {"base_path": f"{url}/data", "storage_options": endpoint_options, **data},
        "cache": {"url": f"{url}/cache", "shard_samples": 4, "storage_options": endpoint_options},
        "preprocess": {"batch_size": 8, "device": "cpu"},
        "output": {"url": str(root / "output")},
    }
