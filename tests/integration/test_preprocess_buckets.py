"""Stage 1 on samples of two sizes: V2 batches hold one shape, shards mix them, bytes are stable.

The demo family is patched to crop odd metadata lines to 32x48 and the others to 64x64 (what
aspect-ratio buckets give); every cached sample must equal V2 run on that sample alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from splitstage.config.job import config_from_dict
from splitstage.data.dataset import load_sample
from splitstage.data.digits import write_digits_dataset
from splitstage.data.index import index_data_set
from splitstage.pipelines.demo.family import DemoFamily
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units, split_batch
from splitstage.tasks.job_plan import make_plan, open_cache
from splitstage.tasks.stage1.preprocess import preprocess
from tests.helpers.demo_job import demo_sections


@pytest.fixture
def assets(tmp_path, demo_weights) -> Path:
    write_digits_dataset(tmp_path / "data", limit=20)
    return tmp_path


@pytest.fixture
def two_sizes(monkeypatch):
    def load(self, row, base_path):
        return load_sample(row, base_path, (32, 48) if row.line % 2 else 64)

    monkeypatch.setattr(DemoFamily, "load_sample", load)


def job(assets: Path, weights: dict, cache: Path, **preprocess_fields):
    return config_from_dict(
        {
            **demo_sections(weights),
            "data": {"base_path": str(assets / "data")},
            "cache": {"url": str(cache), "shard_samples": 6},
            "preprocess": {"batch_size": 4, "device": "cpu", **preprocess_fields},
        }
    )


def one_at_a_time(config) -> dict[str, dict]:
    """V2 on each sample alone: what the cache must hold."""
    plan, data = make_plan(config), index_data_set(config)
    family = plan.family
    cpu = torch.device("cpu")
    models = {m: family.build_model(m, cpu) for m in plan.split.models["stage1"]}
    ctx = StepContext(models=models, device=cpu, settings=family.settings())
    out, base = {}, config.data.base_path
    with torch.no_grad():
        for row, key in zip(data.rows, data.keys):
            batch = run_units(plan.v2_units, ctx, collate_samples([family.load_sample(row, base)]))
            out[key] = split_batch(batch, plan.split.boundary_params, 1)[0]
    return out


def test_two_sizes_are_batched_apart_and_cached_exactly(
    assets, demo_weights, tmp_path, two_sizes, monkeypatch
):
    config = job(assets, demo_weights, tmp_path / "a")
    report = preprocess(config, workers=1, progress=False)
    assert (report.computed, report.shards_written) == (20, 4)
    store = open_cache(make_plan(config))
    got = store.read_samples(sorted(store.committed_keys()))
    shapes = sorted(tuple(s["input_latents"].shape) for s in got.values())
    assert shapes == [(4, 4, 6)] * 10 + [(4, 8, 8)] * 10
    want = one_at_a_time(config)
    assert got.keys() == want.keys()
    for key, sample in got.items():
        for param, value in sample.items():
            if isinstance(value, torch.Tensor):
                assert torch.allclose(value, want[key][param], atol=1e-5), (key, param)
            else:
                assert value == want[key][param], (key, param)
    shards = store.read_shards(sorted(set(store.shard_of(got).values())))
    sizes = [{tuple(s["input_latents"].shape) for s in shard.values()} for shard in shards.values()]
    assert max(len(s) for s in sizes) == 2  # a shard may mix sizes

    monkeypatch.setenv("SPLITSTAGE_DECODE_THREADS", "1")  # other timing, same shard bytes
    again = job(assets, demo_weights, tmp_path / "b")
    preprocess(again, workers=1, progress=False)
    names = {p.name for p in Path(store.root).glob("shards/*")}
    other = open_cache(make_plan(again))
    assert names == {p.name for p in Path(other.root).glob("shards/*")}
    shutil.rmtree(tmp_path / "b")
