"""Write and read time of the index memo alone (no data set): encode + atomic write to a local
disk, then read + load + restore, for synthetic rows (a 40-byte path, a 30-byte prompt, a key,
a local mtime) at each size given; best of --repeat runs, and the file size.

    .venv/bin/python bench/bench_index_memo.py                  # 100k and 1M rows
    .venv/bin/python bench/bench_index_memo.py --rows 100000 --repeat 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time

from fsspec.implementations.local import LocalFileSystem

from splitstage.data import index_memo
from splitstage.data.dataset import Row
from splitstage.data.source import Listing
from splitstage.storage.files import write_atomic

STARTED = 10**19  # every file far older than the trust margin


def result_of(rows: int) -> tuple[index_memo.IndexResult, Listing, list[str]]:
    """A memo's input for `rows` rows, each with its own image file."""
    images = [f"img/{i // 1000:05d}/{i:07d}-some-longer-name.png" for i in range(rows)]
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(rows)]
    table = [
        Row(i + 2, image, f"a picture of thing {i}", {}, "metadata.csv")
        for i, image in enumerate(images)
    ]
    listing = Listing(
        {p: (100 + i % 50, 1_700_000_000_000_000_000 + i) for i, p in enumerate(images)},
        STARTED,
        True,
    )
    return index_memo.IndexResult(table, keys, [(1, "bad row")], 0, rows), listing, images


def run(rows: int, repeat: int, folder: str) -> None:
    result, listing, images = result_of(rows)
    fs, path = LocalFileSystem(), os.path.join(folder, f"memo-{rows}" + index_memo.SUFFIX)
    write, read = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        data = index_memo.encode(
            result,
            data_url="file:///d",
            rules="r",
            metadata_stat=(1, 2),
            listing=listing,
            depends=images,
            absent=[],
        )
        assert data is not None
        write_atomic(fs, path, data)
        write.append(time.perf_counter() - start)
        start = time.perf_counter()
        got = index_memo.load(fs, path, path, data_url="file:///d", rules="r")
        assert got is not None
        back = index_memo.restore(*got)
        assert len(back.keys) == rows and len(index_memo.files_of(got)) == rows
        read.append(time.perf_counter() - start)
    size = os.path.getsize(path) / 2**20
    print(
        f"{rows:>9,} rows  write {min(write):7.3f} s  read {min(read):7.3f} s  "
        f"file {size:7.1f} MiB  ({index_memo.SUFFIX})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for rows in args.rows:
            run(rows, args.repeat, folder)


if __name__ == "__main__":
    main()
