"""Index build time of a large data set: first run, rerun with no new samples (the hash memo),
and after adding, editing and deleting a few files; 8x8 PNGs of ~100 bytes, each distinct.
A rerun takes rows and keys from the index memo after one os.stat per file (in child processes
from 100k files, and once more in this process alone for comparison;
`SPLITSTAGE_STAT_PROCESSES` forces a count); a change to the metadata rebuilds from the hash
memo.

Local disk (default 1,000,000 rows) and the S3 endpoint on loopback (moto server in its own
process; default 100,000 rows, uploaded with batched puts). Goal: rerun / first run <= 0.02.

    .venv/bin/python bench/bench_data_index.py                      # 1M local + 100k S3
    .venv/bin/python bench/bench_data_index.py --rows 100000 --s3-rows 10000
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

CHANGES = 10  # files added, edited and deleted each for the "changed" run
PER_FOLDER = 1000


def png(i: int) -> bytes:
    """A valid 8x8 grey PNG whose tEXt chunk holds `i`: ~100 bytes, distinct bytes per i."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", 8, 8, 8, 0, 0, 0, 0)
    pixels = zlib.compress(b"".join(b"\0" + bytes([(i + y) % 256]) * 8 for y in range(8)))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"tEXt", b"id\0" + str(i).encode())
        + chunk(b"IDAT", pixels)
        + chunk(b"IEND", b"")
    )


def name(i: int) -> str:
    return f"img/{i // PER_FOLDER:05d}/{i}.png"


def metadata(ids: list[int]) -> bytes:
    return ("image,prompt\n" + "".join(f"{name(i)},picture {i}\n" for i in ids)).encode()


def write_local(root: Path, rows: int) -> None:
    for folder in range(0, rows, PER_FOLDER):
        (root / name(folder)).parent.mkdir(parents=True, exist_ok=True)
    for i in range(rows):
        with open(root / name(i), "wb") as fh:
            fh.write(png(i))
    (root / "metadata.csv").write_bytes(metadata(list(range(rows))))


def change_local(root: Path, rows: int) -> None:
    """Add CHANGES new files, edit CHANGES (same size, new bytes), delete CHANGES."""
    ids = list(range(CHANGES, rows + CHANGES))  # the first CHANGES deleted, CHANGES added
    for i in range(rows, rows + CHANGES):
        (root / name(i)).parent.mkdir(parents=True, exist_ok=True)
        (root / name(i)).write_bytes(png(i))
    for i in range(CHANGES, 2 * CHANGES):
        (root / name(i)).write_bytes(png(i + 7 * rows))
    for i in range(CHANGES):
        (root / name(i)).unlink()
    (root / "metadata.csv").write_bytes(metadata(ids))


def timed(config) -> tuple[float, object]:
    from splitstage.data.index import index_data_set

    start = time.perf_counter()
    index = index_data_set(config)
    return time.perf_counter() - start, index


def in_process_rerun(config) -> tuple[float, object]:
    """A rerun whose file check runs in this process alone (no child processes), for
    comparison."""
    os.environ["SPLITSTAGE_STAT_PROCESSES"] = "1"
    try:
        return timed(config)
    finally:
        del os.environ["SPLITSTAGE_STAT_PROCESSES"]


def listing_alone(config, index) -> tuple[float, None]:
    """The one listing a rerun makes (the folders the rows of `index` name), and nothing else:
    the floor under a rerun, which must see every file's size and version."""
    from splitstage.data.source import open_data_source, relative_key

    rels = [relative_key(row.image) for row in index.rows]
    source = open_data_source(config.data)
    start = time.perf_counter()
    source.listing(rels)
    return time.perf_counter() - start, None


def run_case(label: str, config, change, local: bool) -> list[tuple[str, float, object]]:
    time.sleep(2.1)  # past the memo's mtime-tick margin, as any data set written earlier is
    first = timed(config)
    rerun = timed(config)
    if local:
        extra = [(f"{label} rerun, check in process", *in_process_rerun(config))]
    else:
        extra = [(f"{label} its listing alone", *listing_alone(config, rerun[1]))]
    change()
    time.sleep(2.1)
    changed = timed(config)
    out = [(f"{label} first run", *first), (f"{label} rerun", *rerun)]
    out.append((f"{label} after +{CHANGES}/~{CHANGES}/-{CHANGES}", *changed))
    return out + extra


def local_case(rows: int, work: Path):
    from splitstage.config.job import config_from_dict

    data = work / "local-data"
    start = time.perf_counter()
    write_local(data, rows)
    print(f"wrote {rows:,} local images in {time.perf_counter() - start:.1f} s", flush=True)
    config = config_from_dict(
        {"data": {"base_path": str(data)}, "cache": {"url": str(work / "local-cache")}}
    )
    return run_case(f"local {rows:,}", config, lambda: change_local(data, rows), local=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_seeded(port: int, rows: int) -> None:
    """A moto S3 server on loopback whose bucket `bench` is filled through moto's backend, in
    this process (HTTP puts take ~75 objects/s here: 20 min for 100k); serves until stdin ends."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    backend.create_bucket("bench", "us-east-1")
    for i in range(rows):
        backend.put_object("bench", f"data/{name(i)}", png(i))
    backend.put_object("bench", "data/metadata.csv", metadata(list(range(rows))))
    print("ready", flush=True)
    sys.stdin.read()
    server.stop()


def s3_case(rows: int, work: Path):
    import s3fs

    from splitstage.config.job import config_from_dict

    port = free_port()
    start = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve-seeded", str(port), str(rows)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # its request log
        text=True,
    )
    try:
        assert server.stdout is not None
        while (line := server.stdout.readline()) and line.strip() != "ready":
            pass  # moto's own start-up line comes first
        if not line:
            raise RuntimeError("the seeded moto server did not start")
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(
            AWS_ACCESS_KEY_ID="key",
            AWS_SECRET_ACCESS_KEY="secret",
            AWS_EC2_METADATA_DISABLED="true",
        )
        fs = s3fs.S3FileSystem(key="key", secret="secret", client_kwargs={"endpoint_url": endpoint})
        print(f"seeded {rows:,} objects in {time.perf_counter() - start:.1f} s", flush=True)
        config = config_from_dict(
            {
                "data": {
                    "base_path": "s3://bench/data",
                    "storage_options": {"endpoint_url": endpoint},
                },
                "cache": {"url": "s3://bench/cache", "storage_options": {"endpoint_url": endpoint}},
            }
        )

        def change():
            ids = list(range(CHANGES, rows + CHANGES))
            files = {f"bench/data/{name(i)}": png(i) for i in range(rows, rows + CHANGES)}
            files.update(
                {f"bench/data/{name(i)}": png(i + 7 * rows) for i in range(CHANGES, 2 * CHANGES)}
            )
            files["bench/data/metadata.csv"] = metadata(ids)
            fs.pipe(files)
            fs.rm([f"bench/data/{name(i)}" for i in range(CHANGES)])

        return run_case(f"s3 {rows:,}", config, change, local=False)
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="local rows (0: skip)")
    parser.add_argument("--s3-rows", type=int, default=100_000, help="S3 rows (0: skip)")
    parser.add_argument("--serve-seeded", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_seeded:
        return serve_seeded(*args.serve_seeded)
    work = Path(tempfile.mkdtemp(prefix="bench-data-index-"))
    results = []
    try:
        if args.rows:
            results += local_case(args.rows, work)
        if args.s3_rows:
            results += s3_case(args.s3_rows, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'case':<40} {'seconds':>9} {'hashed':>9} {'memo hits':>10} {'index memo':>11}")
    for label, seconds, index in results:
        if index is None:
            print(f"{label:<40} {seconds:>9.2f}")
            continue
        memo = "used" if index.from_memo else "-"
        print(f"{label:<40} {seconds:>9.2f} {index.hashed:>9,} {index.memo_hits:>10,} {memo:>11}")
    starts = [i for i, r in enumerate(results) if r[0].endswith(" first run")]
    for i in starts:
        first, rerun, changed = (r[1] for r in results[i : i + 3])
        label = results[i][0].rsplit(" first run", 1)[0]
        print(
            f"{label}: rerun / first = {rerun / first:.3f} (goal <= 0.02); "
            f"changed / first = {changed / first:.3f}"
        )
        single = [r[1] for r in results if r[0] == f"{label} rerun, check in process"]
        if single:
            print(f"{label}: rerun with the check in process / first = {single[0] / first:.3f}")
        alone = [r[1] for r in results if r[0] == f"{label} its listing alone"]
        if alone:
            print(
                f"{label}: its listing alone / first = {alone[0] / first:.3f} (the floor); "
                f"rerun / its listing alone = {rerun / alone[0]:.2f}"
            )


if __name__ == "__main__":
    main()
