"""The fast shard encoder writes safetensors' own bytes and finds exactly the identical tensors."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load, save

from splitstage.tasks.cache.shard_encode import Dedupe, serialize
from splitstage.tasks.cache.shard_format import encode_shard


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "b/latents": torch.randn(4, 8, 8, generator=g),
        "a/emb": torch.randn(16, 3, generator=g).to(torch.bfloat16),
        "c/mask": torch.rand(7, generator=g) > 0.5,
        "d/ids": torch.arange(5, dtype=torch.int64),
        "e/scalar": torch.tensor(3.5, dtype=torch.float64),
        "f/empty": torch.zeros(0, 3),
        "g/half": torch.ones(3, dtype=torch.float16),
        "h/u8": torch.arange(9, dtype=torch.uint8),
        "i/i32": torch.arange(3, dtype=torch.int32),
    }


def test_serialize_writes_exactly_the_bytes_safetensors_writes():
    tensors = mixed()
    meta = {"splitstage": '{"values":{"k":"a \\"quoted\\" \\u00e9 text"}}'}
    ours = serialize(tensors, meta)
    assert ours == save(tensors, metadata=meta)
    back = load(ours)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert serialize(tensors, {}) == save(tensors)


def test_serialize_other_dtypes_and_tensors_save_would_refuse():
    tensors = {
        "f8": torch.arange(4, dtype=torch.float32).to(torch.float8_e4m3fn),
        "u16": torch.arange(3, dtype=torch.int32).to(torch.uint16),
        "c64": torch.ones(2, dtype=torch.complex64),
    }
    assert serialize(tensors, {"k": "v"}) == save(tensors, metadata={"k": "v"})
    view = torch.arange(12.0).view(3, 4).t()  # not contiguous: save's own error, no pointer
    with pytest.raises(ValueError, match="non contiguous"):
        serialize({"t": view}, {})


def reference_dedupe(tensors: dict[str, torch.Tensor]) -> dict[str, str | None]:
    """What the cache always meant: same dtype, shape and bytes (blake2b of all of them)."""
    seen: dict[tuple, str] = {}
    out = {}
    for name, t in tensors.items():
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        content = (t.dtype, tuple(t.shape), hashlib.blake2b(raw).digest())
        out[name] = seen.get(content)
        seen.setdefault(content, name)
    return out


def test_dedupe_finds_identical_tensors_and_only_those():
    base = torch.randn(64, 64)
    near = base.clone()
    near.view(-1)[1] += 1.0  # differs in a byte the fingerprint does not sample
    zeros, negzeros = torch.zeros(300), -torch.zeros(300)  # equal values, different bytes
    tensors = {
        "a": base,
        "b": near,
        "c": base.clone(),
        "d": zeros,
        "e": negzeros,
        "f": zeros.clone(),
        "g": base.clone().to(torch.float64),
        "h": base.reshape(64 * 64).clone(),
        "i": near.clone(),
    }
    dedupe = Dedupe()
    found = {name: dedupe.first(t, name) for name, t in tensors.items()}
    assert found == reference_dedupe(tensors)
    expected = {"c": "a", "f": "d", "i": "b"}  # the rest: None
    assert found == {name: expected.get(name) for name in tensors}


def test_encode_shard_stores_a_repeated_tensor_once_and_is_deterministic():
    empty = torch.randn(16, 8)
    samples = {
        f"{i:02d}": {"emb": empty.clone() if i % 2 else torch.randn(16, 8), "n": i}
        for i in range(6)
    }
    data, specs = encode_shard(samples)
    stored = load(data)
    assert sorted(stored) == ["00/emb", "01/emb", "02/emb", "04/emb"]
    assert specs["03"]["emb"]["same_as"] == "01/emb" and specs["05"]["emb"]["same_as"] == "01/emb"
    assert encode_shard(samples)[0] == data
