"""Object-store listings cut into key ranges (real S3 endpoint: moto server on loopback): the
ranges together list exactly what one `find` lists, whatever names bound them."""

from __future__ import annotations

import pytest

from splitstage.data.source import DataSource
from splitstage.storage import object_listing
from splitstage.storage.object_listing import list_concurrently

pytestmark = pytest.mark.slow
ROOT = "bucket/prefix/data"
PAGE_KEYS: list[int] = []
IGNORE_START_AFTER: list[bool] = []


@pytest.fixture
def fs(s3_bucket):
    import s3fs

    return s3fs.S3FileSystem(**s3_bucket[1])


@pytest.fixture
def range_requests(fs, monkeypatch) -> list[dict]:
    """Ranges of 3 named keys; records the ListObjectsV2 requests made (pages of `page_keys[0]`
    keys where a test sets it; S3's 1,000 otherwise)."""
    monkeypatch.setattr(object_listing, "RANGE_KEYS", 3)
    calls: list[dict] = []
    real = fs._call_s3

    async def spy(method, *args, **kwargs):
        if method == "list_objects_v2":
            calls.append(dict(kwargs))
            if PAGE_KEYS:
                kwargs["MaxKeys"] = PAGE_KEYS[0]
            if IGNORE_START_AFTER:
                kwargs.pop("StartAfter", None)
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", spy)
    return calls


def files_of(found: dict) -> dict:
    """{name: (size, ETag)} of the files in a listing (folders left out, as listings do)."""
    return {
        name: (info["size"], info.get("ETag"))
        for name, info in found.items()
        if info.get("type") != "directory"
    }


def test_key_ranges_list_exactly_what_one_find_lists(fs, range_requests):
    named = [f"img/{i:03d}.png" for i in range(0, 60, 2)]  # every other one is named
    unnamed = [f"img/{i:03d}.png" for i in range(1, 60, 2)]  # ... the rest lie between them
    odd = ["img/000 space.png", "img/ümlaut+plus.png", "img/sub/deep.png", "a-first.png", "zz.png"]
    fs.pipe({f"{ROOT}/{name}": name.encode() * 3 for name in named + unnamed + odd})
    fs.pipe({f"{ROOT}/img/marker/": b""})  # a folder marker object
    gone = [f"img/{i:03d}.png" for i in range(60, 70)]  # named by rows, not there: bounds too
    expected = files_of(fs.find(ROOT, detail=True))
    assert len(expected) == len(named + unnamed + odd) + 1  # the marker: a file to `find`

    got = list_concurrently(fs, ROOT, [""], named + gone)
    assert files_of(got) == expected
    ranged = [c for c in range_requests if "StartAfter" in c]
    assert len(ranged) >= 5, "the listing was not cut into key ranges"

    range_requests.clear()
    in_img = list_concurrently(fs, ROOT, ["img"], named + gone)
    assert files_of(in_img) == {n: v for n, v in expected.items() if n.startswith(f"{ROOT}/img/")}
    assert {c["Prefix"] for c in range_requests} == {"prefix/data/img/"}


def test_a_bucket_as_the_base_is_cut_into_ranges_too(fs, range_requests):
    names = [f"{i:02d}.png" for i in range(12)]
    fs.pipe({f"bucket/{name}": b"x" for name in [*names, "zz/late.png"]})
    got = list_concurrently(fs, "bucket", [""], names)
    assert files_of(got) == files_of(fs.find("bucket", detail=True))
    assert len(got) == 13 and {c["Prefix"] for c in range_requests} == {""}
    assert sum("StartAfter" in c for c in range_requests) == 3


def test_ranges_and_plain_folders_mix_and_missing_folders_list_empty(fs, range_requests):
    big = [f"big/{i:02d}.png" for i in range(12)]
    small = ["small/a.png", "small/b.png"]
    fs.pipe({f"{ROOT}/{name}": b"x" for name in big + small + ["other/c.png"]})
    got = list_concurrently(fs, ROOT, ["big", "small", "nothing"], big + small + ["nothing/x"])
    assert sorted(got) == sorted(f"{ROOT}/{n}" for n in big + small)  # not other/
    assert any("StartAfter" in c for c in range_requests)


def test_a_data_source_listing_is_the_same_with_and_without_key_ranges(
    s3_bucket, fs, range_requests, monkeypatch
):
    url, options = s3_bucket
    names = [f"{i:04d}.png" for i in range(25)]
    fs.pipe({f"{ROOT}/{name}": name.encode() for name in names})
    source = DataSource(f"{url}/data", options)
    ranged = source.listing(names[::2])
    assert any("StartAfter" in c for c in range_requests)
    monkeypatch.setattr(object_listing, "RANGE_KEYS", 10**9)
    range_requests.clear()
    plain = source.listing(names[::2])
    assert not any("StartAfter" in c for c in range_requests)
    assert ranged.files == plain.files and len(plain.files) == 25


def test_a_range_ending_on_its_bound_needs_no_page_more(fs, range_requests):
    names = [f"{i:02d}.png" for i in range(12)]
    fs.pipe({f"{ROOT}/{name}": b"x" for name in names})
    PAGE_KEYS.append(3)  # pages of 3 keys: each range of 3 ends exactly on a page
    try:
        got = list_concurrently(fs, ROOT, [""], names)
    finally:
        PAGE_KEYS.clear()
    assert len(got) == 12
    assert len(range_requests) == 4  # one page per range, not a second one to see the end


def test_a_store_ignoring_start_after_is_listed_as_one_chain(fs, range_requests, caplog):
    names = [f"{i:02d}.png" for i in range(12)]
    fs.pipe({f"{ROOT}/{name}": b"x" for name in names})
    IGNORE_START_AFTER.append(True)  # the server sees no StartAfter: every range from the start
    try:
        got = list_concurrently(fs, ROOT, [""], names)
    finally:
        IGNORE_START_AFTER.clear()
    assert sorted(got) == [f"{ROOT}/{name}" for name in names]
    assert "key ranges failed (UnorderedListing" in caplog.text
    assert "listing it as one chain instead" in caplog.text


def test_directory_buckets_and_version_listings_are_not_cut(fs):
    assert object_listing._ranges_work(fs, "bucket/data")
    assert not object_listing._ranges_work(fs, "data--use1-az4--x-s3/images")
    assert not object_listing._ranges_work(object(), "bucket/data")  # not s3fs


def test_range_bounds_split_the_names_evenly(monkeypatch):
    monkeypatch.setattr(object_listing, "RANGE_KEYS", 10)
    names = [f"{i:03d}" for i in range(100)]
    assert object_listing._bounds(names) == [f"{i:03d}" for i in range(9, 99, 10)]
    assert object_listing._bounds(names[:19]) == []  # fewer than two ranges' worth
    monkeypatch.setattr(object_listing, "MAX_RANGES", 4)
    assert object_listing._bounds(names) == ["024", "049", "074"]
    assert object_listing._under(sorted(["a/1", "a-b/2", "a/b/3", "ab/4", "b/5"]), "a") == [
        "a/1",
        "a/b/3",
    ]
