"""The compact cache index: index entry formats 1 and 2, key tables, look-ups, groups, the
samples file stage 2 ranks read (local disk, no servers)."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest
import torch

import splitstage.tasks.cache.shard_format as fmt
from splitstage.tasks.cache.fingerprint import stable_hash
from splitstage.tasks.cache.key_table import KeyFileError, KeyTable
from splitstage.tasks.cache.reader import CacheDataset, epoch_order
from splitstage.tasks.cache.store import CacheCorruptError, CacheStore, SampleNotCachedError


def hexkey(i: int) -> str:
    """A 64-hex sample key, as stage 1 names samples."""
    return hashlib.sha256(str(i).encode()).hexdigest()


def sample(i: int, shape=(1, 2, 2)) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"input_latents": torch.randn(*shape, generator=g), "emb": torch.zeros(3), "h": i}


def v1_entry(data: bytes) -> bytes:
    """The format-1 form of a format-2 index entry (what older splitstage wrote)."""
    entry = json.loads(data)
    specs, rows = entry.pop("specs"), entry["samples"]
    entry |= {"format": 1, "samples": {k: specs[r] for k, r in rows.items()}}
    return json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()


# ---- index entry formats ---------------------------------------------------------------------
def test_format_2_entries_hold_a_deduplicated_spec_table_and_format_1_still_reads():
    samples = {hexkey(i): sample(i, (1, 2, 2) if i % 2 else (1, 2, 4)) for i in range(6)}
    info, _, data = fmt.prepare_shard(samples)
    raw = json.loads(data)
    assert raw["format"] == fmt.FORMAT_VERSION == 2
    assert len(raw["specs"]) < len(raw["samples"]) == 6  # same_as rows differ from the first
    v2 = fmt.parse_index_entry(data, info.shard_id, "v2")
    v1 = fmt.parse_index_entry(v1_entry(data), info.shard_id, "v1")
    assert dict(v2.samples) == dict(v1.samples)
    assert v2.samples[hexkey(1)]["input_latents"] == {"dtype": "float32", "shape": [1, 2, 2]}
    assert v2.samples[hexkey(0)]["h"] == "json"
    assert len(v1.samples.table) == len(v2.samples.table)  # format 1 interned on reading


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda e: e.pop("specs"), "bad field 'specs'"),
        (lambda e: e.update(specs={}), "bad field 'specs'"),
        (lambda e: e["samples"].update({next(iter(e["samples"])): 9}), "bad entry for sample"),
        (lambda e: e["samples"].update({next(iter(e["samples"])): True}), "bad entry for sample"),
        (lambda e: e["specs"][0].update(emb={"dtype": "f", "shape": [-1]}), r"sample .* \['emb'\]"),
        (lambda e: e["specs"].append({}), r"specs row \d+, used by none"),
        (lambda e: e["samples"].update({"no/slash": 0}), "bad entry for sample 'no/slash'"),
    ],
)
def test_bad_format_2_entries_are_corrupt_naming_the_entry_and_the_fix(edit, says):
    info, _, data = fmt.prepare_shard({hexkey(1): sample(1), hexkey(2): sample(2)})
    entry = json.loads(data)
    edit(entry)
    with pytest.raises(CacheCorruptError, match=says) as err:
        fmt.parse_index_entry(json.dumps(entry).encode(), info.shard_id, "index/x.json")
    assert "index entry index/x.json" in str(err.value) and "rerun preprocess" in str(err.value)


def test_a_cache_of_format_1_entries_reads_and_checks(tmp_path):
    store = CacheStore(str(tmp_path), "ck")
    infos = store.write_shards([{hexkey(i): sample(i)} for i in range(3)])
    for info in infos:
        path = tmp_path / "ck" / "index" / f"{info.shard_id}.json"
        path.write_bytes(v1_entry(path.read_bytes()))
    old = CacheStore(str(tmp_path), "ck")
    assert old.committed_keys() == {hexkey(i) for i in range(3)}
    assert torch.equal(
        old.read_samples([hexkey(2)])[hexkey(2)]["input_latents"], sample(2)["input_latents"]
    )
    assert old.verify().ok


# ---- key tables ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "keys",
    [
        [hexkey(i) for i in range(50)],
        ["b", "a", "ab", "a-1", "Zz", "a"],  # not hex: NUL-padded ASCII
        ["ABCD", "abcd"],  # uppercase is not packed as hex (it would collide)
    ],
)
def test_key_tables_sort_and_find_as_str_keys_do(keys, tmp_path):
    table = KeyTable.from_keys(keys)
    assert list(table) == sorted(set(keys)) == table.to_list()
    assert [table[i] for i in range(len(table))] == sorted(set(keys))
    probe = [keys[0], "zzz-not-there", keys[-1]]
    assert table.contains(probe).tolist() == [True, False, True]
    assert keys[0] in table and "nope" not in table
    assert table.json_hash() == stable_hash(sorted(set(keys)))
    table.save(tmp_path / "k.safetensors")
    assert KeyTable.load(tmp_path / "k.safetensors") == table


def test_tables_of_different_encodings_compare_by_their_keys():
    hexed = KeyTable.from_keys([hexkey(1), hexkey(2)])
    ascii_ = KeyTable.from_keys([hexkey(1), "x"])
    assert hexed.hexed and not ascii_.hexed
    assert hexed.contains(ascii_).tolist() == [True, False]  # hexkey(1) < "x"
    assert hexed.without(ascii_).to_list() == [hexkey(2)]
    assert KeyTable.from_keys([]).json_hash() == stable_hash([])


def test_a_samples_file_that_is_not_one_is_refused_naming_it(tmp_path):
    bad = tmp_path / "samples.safetensors"
    bad.write_bytes(b"not safetensors")
    with pytest.raises(KeyFileError, match="samples.safetensors is not a splitstage"):
        KeyTable.load(bad)
    unsorted = KeyTable(np.array([b"b", b"a"], "S1"), False)
    unsorted.save(bad)
    with pytest.raises(KeyFileError, match="not sorted and distinct"):
        KeyTable.load(bad)
    good = KeyTable.from_keys([hexkey(3), hexkey(1)])
    good.save(bad)
    assert KeyTable.load(bad) == good


# ---- compact index in the store ----------------------------------------------------------------
@pytest.fixture
def store(tmp_path) -> CacheStore:
    """Two shards sharing sample 2, a third of another latent shape."""
    store = CacheStore(str(tmp_path / "cache"), "ck")
    store.infos = store.write_shards(
        [
            {hexkey(i): sample(i) for i in (1, 2)},
            {hexkey(i): sample(i) for i in (2, 3)},
            {hexkey(i): sample(i, (1, 4, 2)) for i in (4, 5, 6)},
        ]
    )
    return store


def test_look_ups_duplicates_and_missing_keys(store):
    fresh = CacheStore(store.base_url, "ck")
    both = sorted(info.shard_id for info in store.infos[:2])
    assert fresh.shard_of([hexkey(2)])[hexkey(2)] == both[0]  # the lowest shard id owns it
    assert hexkey(2) in fresh._entry(both[1]).samples  # the other copy stays listed
    stats = fresh.stats()
    assert (stats.samples, stats.shards, stats.duplicates) == (6, 3, 1)
    assert stats.duplicate_keys == [hexkey(2)]
    assert fresh.key_table().to_list() == sorted(hexkey(i) for i in range(1, 7))
    assert fresh.contains([hexkey(9), hexkey(4)]).tolist() == [False, True]
    assert fresh.missing([hexkey(9), hexkey(1), hexkey(8)]).to_list() == sorted(
        [hexkey(8), hexkey(9)]
    )
    with pytest.raises(SampleNotCachedError, match="1 sample key"):
        fresh.shard_of([hexkey(1), hexkey(9)])


def test_writes_after_a_load_refresh_and_quarantine_keep_the_index_exact(store):
    reader = CacheStore(store.base_url, "ck")
    assert len(reader.key_table()) == 6
    reader.write_shard({hexkey(7): sample(7)})  # merged into the loaded index on look-up
    assert hexkey(7) in reader.key_table()
    other = CacheStore(store.base_url, "ck")
    other.write_shard({hexkey(8): sample(8)})
    assert hexkey(8) not in reader.key_table()
    reader.refresh()
    assert len(reader.key_table()) == 8
    owner = reader.shard_of([hexkey(4)])[hexkey(4)]
    store.fs.pipe_file(f"{store.root}/shards/{owner}.safetensors", b"rotten")
    report = reader.check("all")
    assert report.lost == sorted(hexkey(i) for i in (4, 5, 6))
    assert hexkey(4) not in reader.key_table() and len(reader.key_table()) == 5
    assert reader.quarantine(report.damaged)
    assert CacheStore(store.base_url, "ck").stats().samples == 5


def test_groups_follow_param_shapes_with_readable_labels(store):
    ds = CacheDataset(CacheStore(store.base_url, "ck"))
    labels = [ds.group_labels[g] for g in ds.groups]
    want = {hexkey(i): "input_latents 1x2x2" for i in (1, 2, 3)}
    want |= {hexkey(i): "input_latents 1x4x2" for i in (4, 5, 6)}
    assert dict(zip(ds.keys, labels)) == want
    assert store.stats().buckets == {"input_latents 1x2x2": 3, "input_latents 1x4x2": 3}
    subset = CacheDataset(store, [hexkey(5), hexkey(1)])
    assert subset.keys.to_list() == sorted([hexkey(1), hexkey(5)]) and len(subset.groups) == 2
    with pytest.raises(SampleNotCachedError, match="1 of 2 sample keys are not in cache"):
        CacheDataset(store, [hexkey(1), hexkey(99)])


def published_order(keys, epoch, seed, rank, world, offset):
    """The epoch order as first published: shuffle the sorted str keys themselves."""
    order = sorted(set(keys))
    random.Random(f"splitstage-epoch:{seed}:{epoch}").shuffle(order)
    order = order[offset:]
    return order[: len(order) - len(order) % world][rank::world]


def test_compact_epoch_orders_equal_the_published_str_order(store):
    ds = CacheDataset(store)
    keys = [hexkey(i) for i in range(1, 7)]
    for rank, world, offset in ((0, 1, 0), (1, 2, 0), (0, 3, 2)):
        want = published_order(keys, 4, 7, rank, world, offset)
        assert ds.epoch_order(4, 7, rank, world, offset) == want
        assert epoch_order(ds.keys, 4, 7, rank, world, offset) == want


def test_group_labels_name_what_differs_between_buckets():
    """Buckets share the prompt's shape and differ in the latents: labels name the latents
    (not the largest tensor, which is the same in every group), distinct and short."""
    from splitstage.tasks.cache.compact_index import group_table

    def spec(h: int, w: int, dtype: str = "float32") -> dict:
        return {
            "prompt_emb": {"dtype": "float32", "shape": [16, 384]},
            "input_latents": {"dtype": dtype, "shape": [4, h, w]},
            "extra": "json",
        }

    numbers, labels = group_table([spec(8, 8), spec(6, 10), spec(8, 8), spec(10, 6)])
    assert numbers[0] == numbers[2] and len(set(numbers.tolist())) == 3
    assert sorted(labels) == ["input_latents 4x10x6", "input_latents 4x6x10", "input_latents 4x8x8"]
    assert group_table([spec(8, 8)])[1] == ["prompt_emb 16x384"]  # one group: its largest
    _, mixed = group_table([spec(8, 8), spec(8, 8, "bfloat16")])
    assert sorted(mixed) == ["input_latents bfloat16 4x8x8", "input_latents float32 4x8x8"]


def test_group_labels_lead_with_the_bucket_in_pixels_when_the_image_sizes_tell_it():
    from splitstage.tasks.cache.group_labels import group_labels, pixel_sizes

    def sig(h: int, w: int) -> tuple:
        return (("input_latents", "float32", (4, h, w)), ("prompt_emb", "float32", (16, 384)))

    order = [sig(8, 8), sig(6, 10), sig(10, 6)]
    buckets = [(48, 80), (64, 64), (80, 48), (32, 128)]  # (height, width) pixels
    assert pixel_sizes(order, buckets) == [(64, 64), (48, 80), (80, 48)]  # one factor: 8
    assert group_labels(order, buckets) == [
        "64x64 (input_latents 4x8x8)",
        "80x48 (input_latents 4x6x10)",  # WIDTHxHEIGHT, as validation.sizes writes it
        "48x80 (input_latents 4x10x6)",
    ]
    assert group_labels([sig(8, 8)], [(64, 64)]) == ["64x64 (prompt_emb 16x384)"]
    # no size fits one factor in every group, or none at all: the latent labels alone
    assert pixel_sizes(order, [(64, 64), (48, 80)]) is None
    assert group_labels(order, None) == [
        "input_latents 4x8x8",
        "input_latents 4x6x10",
        "input_latents 4x10x6",
    ]
    # two params that fit and agree (a VAE's latent_mean and latent_logvar): their pixels
    both = [(*s, ("mask", "float32", (1, s[0][2][1], s[0][2][2]))) for s in order]
    assert pixel_sizes(both, buckets) == [(64, 64), (48, 80), (80, 48)]
    vae = [
        (("latent_logvar", "float32", (4, h, w)), ("latent_mean", "float32", (4, h, w)))
        for h, w in ((8, 8), (6, 10))
    ]
    assert group_labels(vae, buckets) == [
        "64x64 (latent_logvar 4x8x8, latent_mean 4x8x8)",
        "80x48 (latent_logvar 4x6x10, latent_mean 4x6x10)",
    ]
    # two params that fit but disagree: which one is the image is unknown, so no pixels
    crossed = [(*s, ("mask", "float32", (1, s[0][2][2], s[0][2][1]))) for s in order]
    assert pixel_sizes(crossed, buckets) is None
