"""Aspect buckets end to end (demo family, real torchrun): three image shapes, batches within one
shape, split equals unsplit, and a 2-rank run resumed on 1 rank finishes the epoch exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from splitstage.pipelines.demo.weight_files import build_demo_weights
from splitstage.tasks.job_plan import make_plan, open_cache
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.batch_plan import plan_epoch
from splitstage.tasks.stage2.batches import CachedBatches
from tests.helpers.tiny_job import tiny_config

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu"}
SHAPES = [(64, 64), (60, 120), (120, 60)]  # source (height, width): square, wide, tall
COUNTS = [13, 10, 7]


def write_shapes(folder: Path) -> None:
    """A data set of coloured images in three aspect ratios, one caption each."""
    folder.mkdir(parents=True)
    lines = ["image,prompt"]
    for shape, ((h, w), count) in enumerate(zip(SHAPES, COUNTS)):
        for i in range(count):
            colour = (40 * shape + 3 * i, 255 - 9 * i, 90 + 20 * shape)
            img = Image.new("RGB", (w, h), colour)
            img.paste((255, 255, 255), (i, i, i + w // 3, i + h // 3))
            img.save(folder / f"{shape}_{i}.png")
            lines.append(f"{shape}_{i}.png,shape {shape} number {i}")
    (folder / "metadata.csv").write_text("\n".join(lines) + "\n")


def config(root: Path, name: str, **train):
    data = tiny_config(root, name, 3, **train).model_dump()
    data["data"] = {"base_path": str(root / "data"), "buckets": {"enabled": True, "step": 16}}
    return type(tiny_config(root, name, 3)).model_validate(data)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("buckets")
    write_shapes(root / "data")
    build_demo_weights(root / "weights")
    preprocess(config(root, "prep"), workers=1, progress=False)
    return root


def run(root: Path, name: str, lines: list[str] | None = None, **fields):
    on_line = lines.append if lines is not None else (lambda line: None)
    return train(config(root, name, **fields), run_root=root / "runs", env=ENV, on_line=on_line)


def test_each_shape_is_cached_at_its_bucket_and_batches_stay_within_one(workspace):
    cfg = config(workspace, "look")
    source = CachedBatches(cfg, open_cache(make_plan(cfg)), 0, 1)
    assert source.group_labels() == {  # the bucket in pixels, WIDTHxHEIGHT, then its latents
        "64x64 (input_latents 4x8x8)": 13,
        "80x48 (input_latents 4x6x10)": 10,  # the wide sources
        "48x80 (input_latents 4x10x6)": 7,
    }
    lines: list[str] = []
    split = run(workspace, "split", lines, max_steps=4)
    unsplit = run(workspace, "unsplit", mode="unsplit", max_steps=4)
    assert split.updates == 4
    assert split.losses == pytest.approx(unsplit.losses, rel=1e-5)
    dropped = sum(n % 4 for n in COUNTS)
    assert split.tail == {"groups": 3, "dropped": dropped, "repeated": 0}
    assert any(f"tail drop: {dropped} samples dropped" in line for line in lines)


def test_two_ranks_resumed_on_one_finish_the_epoch_with_the_unseen_samples(workspace):
    first = run(workspace, "reshard", nproc_per_node=2, max_steps=2, batch_size=2)
    assert first.updates == 2
    cfg = config(workspace, "reshard", max_steps=None, batch_size=3)
    source = CachedBatches(cfg, open_cache(make_plan(cfg)), 0, 1)
    two = plan_epoch(source.groups, source.keys, epoch=0, seed=3, replicas=2, batch_size=2)
    left = plan_epoch(
        source.groups,
        source.keys,
        epoch=0,
        seed=3,
        replicas=1,
        batch_size=3,
        position=two.position_after(2),
    )
    lines: list[str] = []
    second = run(workspace, "reshard", lines, max_steps=None, batch_size=3)
    assert any("resumed from checkpoint step 2" in line for line in lines)
    assert second.updates == 2 + len(left.batches)
    seen = [int(i) for s in range(2) for r in range(2) for i in two.rank_batch(s, r)]
    seen += [int(i) for s in range(len(left.batches)) for i in left.rank_batch(s, 0)]
    assert len(seen) == len(set(seen)) == sum(COUNTS) - left.dropped
