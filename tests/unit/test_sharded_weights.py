"""Sharded safetensors weights (`*.safetensors.index.json`, as save_pretrained writes them):
loaded exactly, each shard opened lazily, and every broken index refused in one named line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from diffusers import ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from safetensors.torch import save_file
from torch import nn

from splitstage.tasks.stage2.pretrained_weights import (
    PretrainedFile,
    WeightsError,
    WeightsFileNotFoundError,
    check_weights_file,
    materialize_and_load,
)

INDEX = "diffusion_pytorch_model.safetensors.index.json"


class TinyDenoiser(ModelMixin, ConfigMixin):
    """A few 32x32 layers and a persistent buffer: about 30 KB, so 10 KB shards give several."""

    @register_to_config
    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.proj_out = nn.Linear(width, 4, bias=False)
        self.register_buffer("scale", torch.arange(width, dtype=torch.float32))


class Payload:
    """Unpickling this object creates a file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture
def sharded(tmp_path) -> tuple[TinyDenoiser, Path]:
    """The original model and its index, saved by diffusers in 10 KB safetensors shards."""
    torch.manual_seed(0)
    model = TinyDenoiser()
    model.save_pretrained(tmp_path / "model", max_shard_size="10KB", safe_serialization=True)
    index = tmp_path / "model" / INDEX
    assert len(set(weight_map(index).values())) >= 3
    return model, index


def weight_map(index: Path) -> dict[str, str]:
    return json.loads(index.read_text())["weight_map"]


def rewrite(index: Path, **changes) -> None:
    """Change the index's weight_map entries (tensor name -> shard file name)."""
    data = json.loads(index.read_text())
    data["weight_map"].update(changes)
    index.write_text(json.dumps(data))


def meta_copy() -> TinyDenoiser:
    with torch.device("meta"):
        return TinyDenoiser()


def load_error(path) -> str:
    """The one-line message of loading `path` into a meta model."""
    with pytest.raises(WeightsError) as failure:
        materialize_and_load(meta_copy(), path, device="cpu")
    message = str(failure.value)
    assert "\n" not in message
    return message


def test_sharded_index_loads_every_tensor_exactly(sharded):
    original, index = sharded
    model = meta_copy()
    report = materialize_and_load(model, index, device="cpu")
    expected = original.state_dict()
    assert report.loaded == len(expected)
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in expected.values())
    loaded = model.state_dict()
    assert loaded.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key
    check_weights_file(meta_copy(), index)


def test_regions_come_from_their_shard_and_each_shard_opens_once_on_first_use(sharded):
    original, index = sharded
    file = PretrainedFile(str(index), "")
    assert set(file.keys) == set(original.state_dict())
    assert file._open == {}  # nothing opened yet
    region = (slice(2, 5), slice(8, 16))
    assert torch.equal(file.read("blocks.3.weight", region), original.blocks[3].weight[region])
    assert file.shape("blocks.3.weight") == (32, 32)
    shard = weight_map(index)["blocks.3.weight"]
    assert [os.path.basename(p) for p in file._open] == [shard]
    handle = file._open[str(index.parent / shard)]
    file.read("blocks.3.bias")
    same = weight_map(index)["blocks.3.bias"] == shard
    assert len(file._open) == (1 if same else 2)
    assert file._open[str(index.parent / shard)] is handle


def test_a_stage_with_some_modules_opens_only_their_shards(sharded):
    original, index = sharded
    model = meta_copy()
    del model.blocks[3:]  # a first pipeline stage: embed and blocks 0..2
    del model.proj_out
    needed = {weight_map(index)[key] for key in model.state_dict()}
    unneeded = set(weight_map(index).values()) - needed
    assert unneeded
    for shard in unneeded:  # a shard this stage opened would now fail to parse
        (index.parent / shard).write_bytes(b"not read")
    report = materialize_and_load(model, index, device="cpu", ignore_unexpected=True)
    assert report.loaded == len(model.state_dict())
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, original.state_dict()[key]), key


def test_key_prefix_applies_to_an_index(tmp_path):
    torch.manual_seed(1)
    original = TinyDenoiser(depth=2)
    tensors = {f"pipe.dit.{k}": v.contiguous() for k, v in original.state_dict().items()}
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:3]}, tmp_path / "a.safetensors")
    save_file({k: tensors[k] for k in names[3:]}, tmp_path / "b.safetensors")
    shards = {k: "a.safetensors" if i < 3 else "b.safetensors" for i, k in enumerate(names)}
    index = tmp_path / "dit.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    model = meta_copy()
    del model.blocks[2:]
    materialize_and_load(model, index, key_prefix="pipe.dit.", device="cpu")
    for key, tensor in original.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key


def test_a_missing_shard_is_named(sharded):
    _, index = sharded
    shard = weight_map(index)["blocks.4.weight"]
    (index.parent / shard).unlink()
    message = load_error(index)
    assert message.startswith(f"weights index {index}: shard file {shard} listed in its weight_map")
    assert "does not exist" in message
    with pytest.raises(WeightsError, match=shard):
        check_weights_file(meta_copy(), index)


def test_a_tensor_absent_from_its_shard_is_named(sharded):
    _, index = sharded
    shards = weight_map(index)
    other = next(s for s in sorted(set(shards.values())) if s != shards["blocks.1.weight"])
    rewrite(index, **{"blocks.1.weight": other})
    message = load_error(index)
    assert message.startswith(f"weights index {index}: shard {other} lacks 1 tensor(s)")
    assert "blocks.1.weight" in message


def test_an_index_that_is_not_json_or_has_no_weight_map_is_refused(sharded):
    _, index = sharded
    index.write_text("{not json")
    assert load_error(index).startswith(f"weights index {index} is not valid JSON")
    index.write_text(json.dumps({"metadata": {"total_size": 1}}))
    assert load_error(index).startswith(f'weights index {index} has no "weight_map" object')
    index.write_text(json.dumps({"weight_map": {"embed.weight": 3}}))
    assert "without a shard file name for embed.weight" in load_error(index)


def test_a_shard_outside_the_index_folder_is_refused(sharded):
    _, index = sharded
    rewrite(index, **{"embed.weight": "../elsewhere.safetensors"})
    assert "must lie beside the index, not ../elsewhere.safetensors" in load_error(index)


def test_a_pickle_shard_is_refused_and_never_unpickled(sharded, tmp_path):
    _, index = sharded
    marker = tmp_path / "pwned"
    shard = weight_map(index)["embed.weight"]
    torch.save({"embed.weight": Payload(marker)}, index.parent / shard)
    message = load_error(index)
    assert message.startswith(f"weights index {index}: shard {shard} is not a safetensors file")
    assert not marker.exists()


def test_a_corrupt_shard_header_is_named(sharded):
    _, index = sharded
    shard = weight_map(index)["embed.weight"]
    (index.parent / shard).write_bytes((100).to_bytes(8, "little") + b"{broken")
    message = load_error(index)
    assert message.startswith(f"weights index {index}: shard {shard} is not a readable")


def test_a_directory_names_what_to_point_at(sharded):
    _, index = sharded
    message = load_error(index.parent)
    assert message.startswith(f"pretrained weights path {index.parent} is a directory")
    assert f"(it holds {INDEX})" in message
    assert "point at the .safetensors file or the .safetensors.index.json" in message


def test_a_missing_path_is_still_file_not_found(tmp_path):
    with pytest.raises(WeightsFileNotFoundError, match="does not exist"):
        materialize_and_load(meta_copy(), tmp_path / "absent.safetensors.index.json", device="cpu")


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_single_files_still_load_exactly(tmp_path, fmt):
    torch.manual_seed(2)
    original = TinyDenoiser()
    path = tmp_path / f"model.{fmt}"
    if fmt == "safetensors":
        save_file(original.state_dict(), path)
    else:
        torch.save(original.state_dict(), path)
    model = meta_copy()
    materialize_and_load(model, path, device="cpu")
    for key, tensor in original.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key
