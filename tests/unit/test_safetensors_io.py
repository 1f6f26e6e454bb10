"""storage/safetensors_io.py: the one parser of safetensors header bytes agrees with safetensors'
own reader, and bad bytes are one ValueError saying what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, save

from splitstage.storage.safetensors_io import canonical, read_header, read_metadata


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
