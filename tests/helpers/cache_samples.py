"""Small demo-shaped cache samples and their bitwise comparison, shared by the cache tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def key_of(i: int) -> str:
    """A hex sample key for sample number i."""
    return f"{i:08x}" + "ab" * 4


def make_sample(i: int) -> dict:
    """A small demo-shaped sample: float tensors, an int tensor, and JSON values."""
    g = torch.Generator().manual_seed(i)
    return {
        "prompt_emb": torch.randn(1, 4, 8, generator=g),
        "latents": torch.randn(1, 4, 2, 2, generator=g).to(torch.bfloat16),
        "ids": torch.arange(i, i + 3),
        "height": 64,
        "width": 64,
        "prompt": f"a photo of digit {i}",
    }


def make_samples(ids) -> dict[str, dict]:
    """Samples keyed by hex key for the given sample numbers."""
    return {key_of(i): make_sample(i) for i in ids}


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes, for bitwise comparison (NaNs and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict, want: dict) -> None:
    """Assert a read sample equals the written one: tensor dtype, shape and bits, JSON values."""
    assert set(got) == set(want)
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[name].dtype == value.dtype, name
            assert got[name].shape == value.shape, name
            assert got[name].device.type == "cpu"
            assert torch.equal(bits(got[name]), bits(value)), name
        else:
            assert got[name] == (list(value) if isinstance(value, tuple) else value), name


def rich_sample() -> dict:
    """Every dtype, NaN and -0.0, 0-d and empty tensors, views and JSON values."""
    base = torch.randn(6, 5)
    base[0, 0], base[0, 1] = float("nan"), -0.0
    sample: dict = {f"t_{str(d)[6:]}": (torch.randn(2, 3) * 50).to(d) for d in DTYPES}
    sample.update(
        {
            "transposed": base.T,
            "strided": base[::2, 1:],
            "row_a": base[1],
            "row_b": base[1],  # the very same view twice
            "expanded": torch.ones(3, 1).expand(3, 4),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 7),
            "grad": torch.ones(2, requires_grad=True) * 2,
            "text": "a cat, ünïcode",
            "n": 7,
            "f": 0.25,
            "flag": True,
            "none": None,
            "nested": {"a": [1, 2.5, None, "x"], "b": {"c": False}},
            "tuple": (1, 2),
        }
    )
    return sample


def run_writer_processes(url: str, options: dict, id_lists: list[list[int]]) -> None:
    """Run one writer process per id list at the same time; fail with their stderr if any fails."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, url, json.dumps(options), json.dumps(ids)],
            cwd=REPO,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for ids in id_lists
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err


CHILD = textwrap.dedent(
    """
    import json, sys
    from tests.helpers.cache_samples import make_samples
    from splitstage.tasks.cache.store import CacheStore
    url, options, ids, size = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), 3
    store = CacheStore(url, "ck", options)
    for i in range(0, len(ids), size):
        store.write_shard(make_samples(ids[i : i + size]))
    """
)
