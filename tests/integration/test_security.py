"""Security: a pickle payload planted where splitstage reads never runs; secrets never leak.

The payload, when unpickled, creates a marker file (`open(marker, "w")`): the tests plant it as a
checkpoint's DCP metadata, as a cache shard (with a matching index entry) and as a `.pt` weights
file, and check the read fails with a named error and the marker does not exist.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from splitstage.tasks.cache.store import CacheCorruptError, CacheStore
from splitstage.tasks.stage2.checkpoint import load_checkpoint, save_checkpoint
from splitstage.tasks.stage2.pretrained_weights import materialize_and_load
from splitstage.tasks.stage2.safe_dcp import UnsafeCheckpointError


class Payload:
    """Unpickling this object creates a file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def payload_bytes(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def test_checkpoint_metadata_payload_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    url = str(tmp_path / "ckpt")
    save_checkpoint(url, 1, model, [optimizer], {"update": 1}, keep_last=1)
    metadata = tmp_path / "ckpt" / "step-00000001" / ".metadata"
    assert metadata.is_file()
    metadata.write_bytes(payload_bytes(marker))
    with pytest.raises(UnsafeCheckpointError, match=r"io.open, which a DCP checkpoint never"):
        load_checkpoint(url, 1, model, [optimizer])
    assert not marker.exists()


def test_cache_shard_payload_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    store = CacheStore(str(tmp_path / "cache"), "key")
    info = store.write_shard({"a" * 64: {"x": torch.ones(2)}})
    shard = Path(store.root) / info.path
    index = Path(store.root) / store.index_file(info.shard_id)
    evil = payload_bytes(marker)
    shard.write_bytes(evil)
    entry = json.loads(index.read_text())
    entry.update(bytes=len(evil), sha256=hashlib.sha256(evil).hexdigest())  # checksum "passes"
    index.write_text(json.dumps(entry))
    fresh = CacheStore(str(tmp_path / "cache"), "key")
    with pytest.raises(CacheCorruptError):
        fresh.read_samples(["a" * 64])
    assert not marker.exists()


def test_pt_weights_payload_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "weights.pt"
    torch.save({"weight": Payload(marker)}, path)
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    with pytest.raises(Exception) as failure:
        materialize_and_load(model, path, device="cpu")
    assert "weights_only" in str(failure.value) or "Unpickl" in type(failure.value).__name__
    assert not marker.exists()
