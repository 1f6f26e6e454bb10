"""storage/safetensors_io.py: the one parser of safetensors header bytes agrees with safetensors'
own reader, and bad bytes are one ValueError saying what is wrong; `mapped_state` maps a file's
tensors (no copy, copy-on-write) and names a bad file in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, save, save_file

from splitstage.splitter import UserError
from splitstage.storage.safetensors_io import (
    canonical,
    mapped_state,
    read_header,
    read_metadata,
)


def blob() -> bytes:
    tensors = {"b": torch.arange(6, dtype=torch.int32).view(2, 3), "a": torch.ones(2)}
    return save(tensors, metadata={"z": "1", "json": '{"k": [1, 2]}'})


def test_header_and_metadata_agree_with_safe_open(tmp_path):
    data = blob()
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    header = read_header(data)
    with safe_open(str(path), framework="pt") as f:
        assert read_metadata(data) == f.metadata() == header["__metadata__"]
        names = set(f.keys())
        for name in names:
            assert header[name]["shape"] == list(f.get_slice(name).get_shape())
    assert names == set(header) - {"__metadata__"}
    size = int.from_bytes(data[:8], "little")
    assert read_header(data[: 8 + size]) == header  # the first bytes are enough
    assert read_metadata(save({"t": torch.zeros(1)})) == {}


def test_canonical_sorts_the_header_and_keeps_the_tensors():
    data = blob()
    again = canonical(data)
    assert canonical(again) == again
    size = int.from_bytes(again[:8], "little")
    text = again[8 : 8 + size].decode().rstrip(" ")
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert (8 + size) % 8 == 0
    back, want = load(again), load(data)
    assert set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "too short (0 bytes"),
        (b"\x10\x00\x00", "too short (3 bytes"),
        ((100).to_bytes(8, "little") + b"{}", "header of 100 bytes runs past the end (2 follow)"),
        ((7).to_bytes(8, "little") + b"{broken", "not valid JSON"),
        ((2).to_bytes(8, "little") + b"\xff\xfe", "not valid JSON"),
        ((2).to_bytes(8, "little") + b"[]", "a JSON list, not an object"),
    ],
)
def test_bad_header_bytes_are_one_value_error(data, needle):
    for parse in (read_header, read_metadata, canonical):
        with pytest.raises(ValueError) as err:
            parse(data)
        assert needle in str(err.value) and "\n" not in str(err.value)


def test_metadata_that_is_not_an_object_is_refused():
    text = b'{"__metadata__":[1]}'
    with pytest.raises(ValueError, match="__metadata__ is a list, not an object"):
        read_metadata(len(text).to_bytes(8, "little") + text)


def file_mappings(path) -> list[tuple[int, int, str]]:
    """This process's mappings of `path` (start, end, permissions), from /proc/self/maps."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, fields[1]))
    return found


def test_mapped_state_maps_the_file_copy_on_write(tmp_path):
    path = tmp_path / "model.safetensors"
    weights = {"w": torch.randn(256, 256), "b": torch.arange(8, dtype=torch.int64)}
    save_file(weights, str(path))
    state = mapped_state(path)
    assert set(state) == {"w", "b"}
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor)
    mappings = file_mappings(path)
    pointer = state["w"].data_ptr()
    inside = [m for m in mappings if m[0] <= pointer < m[1]]
    assert inside, "the tensor is a copy, not the file's mapping"
    assert inside[0][2].endswith("p")  # private: a write stays in this process
    state["w"].add_(1)  # a frozen model never writes; if one did, the file is untouched
    assert torch.equal(mapped_state(path)["w"], weights["w"])


def test_mapped_state_reads_every_shard_of_an_index(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "m-1.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "m-2.safetensors"))
    index = {"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps(index))
    state = mapped_state(tmp_path / "m.safetensors.index.json")
    assert {k: v.tolist() for k, v in state.items()} == {"a": [1.0, 1.0], "b": [0.0] * 3}


def test_mapped_state_names_a_bad_file(tmp_path):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"not safetensors at all")
    with pytest.raises(UserError, match="broken.safetensors: not a readable safetensors file"):
        mapped_state(path)
