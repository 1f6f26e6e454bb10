"""Stage 2 at scale: index load, reader memory and start-up to the first batch, 10^6 samples.

Run: .venv/bin/python bench/bench_stage2_scale.py [--samples 1000000] [--shard-samples 64]
                                                  [--dir runs/bench/stage2_scale] [--no-torchrun]

Writes (once; reused while --samples and --shard-samples match) a cache of tiny samples with
`CacheStore.write_shards` (2 writer processes): a float16 latent of one of 3 shapes (3 groups,
as aspect buckets give) and a [8, 16] float16 embedding, every 10th one the shared empty-prompt
embedding (stored once per shard), plus what the preprocessing coordinator writes: the manifest
(its sample keys compact) and the index snapshot (`CacheStore.write_index_snapshot`, timed: from
scratch, and again with a valid snapshot there, as a rerun writes it). Then, each in a fresh
process: the index load time with the snapshot and without it (every entry read: the fallback),
side by side; a preprocess rerun's cache check the same two ways; the resident-memory growth
of the store + CacheDataset per cached sample (gc first; psutil); wall time from process start
to the first batch of `CachedBatches(...).iterate(0)` after importing the stage-2 worker's
modules (keys from the manifest, as a rank reads them when the cache matches the data set, and
from a samples file); the same under `torchrun --nproc-per-node 1`. Also the index bytes per
sample in format 2 next to format 1.
Goals: memory <= 200 bytes per cached sample; start-up to the first batch <= 10 s.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

T_START = time.time()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(4, 8, 8), (4, 8, 12), (4, 12, 8)]
CACHE_KEY = "scale"


def key_of(i: int) -> str:
    """The sha256 sample key of sample i (as stage 1 names samples: 64 hex digits)."""
    return hashlib.sha256(f"sample-{i}".encode()).hexdigest()


def write_part(root: str, samples: int, shard_samples: int, part: int, parts: int) -> None:
    """Write this writer's shards (every parts-th shard from `part`)."""
    import torch

    from splitstage.tasks.cache.store import CacheStore

    torch.set_num_threads(1)
    store = CacheStore(root, CACHE_KEY)
    gen = torch.Generator().manual_seed(part)
    empty = torch.zeros(8, 16, dtype=torch.float16)
    pool = torch.randn(4 * 12 * 8 * 4096, generator=gen).to(torch.float16)

    def shards():
        for start in range(part * shard_samples, samples, parts * shard_samples):
            out = {}
            for i in range(start, min(start + shard_samples, samples)):
                shape = SHAPES[i % len(SHAPES)]
                n = shape[0] * shape[1] * shape[2]
                at = (i * 131) % (len(pool) - n)
                emb = empty if i % 10 == 0 else pool[at + 7 : at + 135].view(8, 16)
                out[key_of(i)] = {
                    "input_latents": pool[at : at + n].view(shape),
                    "prompt_emb": emb,
                    "height": shape[1] * 8,
                }
            yield out

    store.write_shards(shards())


def ensure_cache(root: Path, samples: int, shard_samples: int) -> float:
    """Write the cache unless a complete one of this size is there; seconds spent writing."""
    stamp = root / "written.json"
    want = {"samples": samples, "shard_samples": shard_samples, "format": 2}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return 0.0
    subprocess.run(["rm", "-rf", str(root)], check=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--write-part",
                str(p),
                "--samples",
                str(samples),
                "--shard-samples",
                str(shard_samples),
                "--dir",
                str(root),
            ]
        )
        for p in range(2)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("a writer failed")
    from splitstage.tasks.cache.store import CacheStore

    CacheStore(str(root), CACHE_KEY).write_manifest(
        {"samples": [key_of(i) for i in range(samples)]}
    )
    stamp.write_text(json.dumps(want))
    return time.perf_counter() - t0


def ensure_coordinator_files(root: Path) -> dict:
    """Rewrite an older manifest (inline sample list) compactly, write the index snapshot from
    scratch, then again with it there (a rerun's cost); seconds of each."""
    from splitstage.tasks.cache.index_snapshot import SNAPSHOT
    from splitstage.tasks.cache.store import CacheStore

    store = CacheStore(str(root), CACHE_KEY)
    out = {}
    if "samples" in json.loads((root / CACHE_KEY / "manifest.json").read_text()):
        t0 = time.perf_counter()
        manifest = store.read_manifest()
        out["old_manifest_read_s"] = time.perf_counter() - t0
        store.write_manifest(manifest)
    (root / CACHE_KEY / SNAPSHOT).unlink(missing_ok=True)
    for name in ("snapshot_write_s", "snapshot_rewrite_s"):
        t0 = time.perf_counter()
        CacheStore(str(root), CACHE_KEY).write_index_snapshot()
        out[name] = time.perf_counter() - t0
    return out


def rss() -> int:
    """Resident bytes of this process after a full collection."""
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss


def measure_memory(root: str, snapshot: bool = True) -> dict:
    """Index load time and the store + CacheDataset memory, in this (fresh) process; without
    `snapshot`, the store reads every index entry (what it falls back to)."""
    import numpy  # noqa: F401  (imported before the baseline)
    import torch  # noqa: F401

    import splitstage.tasks.cache.index_snapshot as snap
    from splitstage.tasks.cache.reader import CacheDataset
    from splitstage.tasks.cache.store import CacheStore

    if not snapshot:
        snap._snapshot = lambda store: None  # the fallback path: read every entry

    base = rss()
    t0 = time.perf_counter()
    store = CacheStore(root, CACHE_KEY)
    table = store.key_table()
    load_s = time.perf_counter() - t0
    after_store = rss()
    t0 = time.perf_counter()
    dataset = CacheDataset(store)
    dataset_s = time.perf_counter() - t0
    after = rss()
    n = len(table)
    labels = {
        label: int((dataset.groups == g).sum()) for g, label in enumerate(dataset.group_labels)
    }
    return {
        "samples": n,
        "index_load_s": load_s,
        "dataset_s": dataset_s,
        "store_bytes_per_sample": (after_store - base) / n,
        "bytes_per_sample": (after - base) / n,
        "groups": labels,
        "stats_groups": store.stats().groups,
        "keys_hash": table.json_hash(),
    }


def measure_check(root: str, snapshot: bool = True) -> dict:
    """A preprocess rerun's cache check (`repair_cache`: "changed", every sample wanted, this
    job's params, touch) in this fresh process; without `snapshot`, the check that reads every
    index entry."""
    import splitstage.tasks.cache.repair as repair
    from splitstage.tasks.cache.store import CacheStore

    if not snapshot:
        repair.snapshot_check = lambda *args: None
    store = CacheStore(root, CACHE_KEY)
    wanted = set(store.read_manifest()["samples"])
    t0 = time.perf_counter()
    report = store.check(
        "changed", keys=wanted, params=["height", "input_latents", "prompt_emb"], touch=True
    )
    seconds = time.perf_counter() - t0
    return {"check_s": seconds, "report": [report.shards_checked, report.samples, report.ok]}


def first_batch(root: str, samples_file: str | None) -> dict:
    """Wall time from process start to the first batch of CachedBatches.iterate(0)."""
    import splitstage.tasks.stage2.worker  # noqa: F401  (what a rank imports)
    from splitstage.config.job import config_from_dict
    from splitstage.tasks.cache.key_table import KeyTable
    from splitstage.tasks.stage2.batches import CachedBatches

    t_imported = time.time()
    config = config_from_dict(
        {
            "trainable": {"lora_base_model": "dit"},
            "models": {"dit": {"builder": "x"}},
            "train": {"batch_size": 8},
        }
    )
    from splitstage.tasks.cache.store import CacheStore

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    store = CacheStore(root, CACHE_KEY)
    keys = KeyTable.load(samples_file) if samples_file else None
    source = CachedBatches(config, store, rank, world, keys=keys)
    batch = next(iter(source.iterate(0)))
    t_first = time.time()
    return {
        "imports_s": t_imported - T_START,
        "to_first_batch_s": t_first - T_START,
        "batch": {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")},
        "rss_mb_at_first_batch": rss() / 2**20,
    }


def child(args: list[str]) -> dict:
    """Run this script in a fresh process; its JSON result, with the wall time from spawn."""
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, __file__, *args],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["from_spawn_s"] = time.time() - t0
    return result


def index_sizes(root: Path) -> dict:
    """Index bytes per sample: format 2 as written, format 1 for the same entries."""
    import splitstage.tasks.cache.shard_format as fmt

    v2 = v1 = n = 0
    for path in sorted((root / CACHE_KEY / "index").glob("*.json"))[:200]:
        data = path.read_bytes()
        entry = fmt.parse_index_entry(data, path.stem, str(path))
        old = {
            "format": 1,
            "shard": entry.shard,
            "bytes": entry.nbytes,
            "sha256": entry.sha256,
            "samples": {k: dict(v) for k, v in entry.samples.items()},
        }
        v2 += len(data)
        v1 += len(json.dumps(old, sort_keys=True, separators=(",", ":")))
        n += len(entry.samples)
    return {"v2_bytes_per_sample": v2 / n, "v1_bytes_per_sample": v1 / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--shard-samples", type=int, default=64)
    parser.add_argument("--dir", default="runs/bench/stage2_scale")
    parser.add_argument("--no-torchrun", action="store_true")
    parser.add_argument("--write-part", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--measure", choices=("memory", "first-batch", "check"), help=argparse.SUPPRESS
    )
    parser.add_argument("--samples-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-snapshot", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    root = Path(args.dir).resolve()
    if args.write_part is not None:
        return write_part(str(root), args.samples, args.shard_samples, args.write_part, 2)
    if args.measure == "memory":
        return print(json.dumps(measure_memory(str(root), not args.no_snapshot)))
    if args.measure == "check":
        return print(json.dumps(measure_check(str(root), not args.no_snapshot)))
    if args.measure == "first-batch":
        return print(json.dumps(first_batch(str(root), args.samples_file)))

    write_s = ensure_cache(root, args.samples, args.shard_samples)
    if write_s:
        print(f"wrote {args.samples} samples in shards of {args.shard_samples}: {write_s:.1f} s")
    coordinator = ensure_coordinator_files(root)
    sizes = index_sizes(root)
    mem = child(["--measure", "memory", "--dir", str(root)])
    full = child(["--measure", "memory", "--dir", str(root), "--no-snapshot"])
    quick_check = child(["--measure", "check", "--dir", str(root)])
    full_check = child(["--measure", "check", "--dir", str(root), "--no-snapshot"])
    from splitstage.tasks.cache.store import CacheStore

    keys_file = root / "samples.safetensors"
    CacheStore(str(root), CACHE_KEY).key_table().save(keys_file)
    base = ["--measure", "first-batch", "--dir", str(root)]
    manifest = child(base)
    from_file = child([*base, "--samples-file", str(keys_file)])
    runs = None
    if not args.no_torchrun:
        t0 = time.time()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "1",
                "--standalone",
                __file__,
                *base,
                "--samples-file",
                str(keys_file),
            ],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        runs = json.loads(out.stdout.strip().splitlines()[-1])
        runs["from_spawn_s"] = time.time() - t0

    n = mem["samples"]
    print(f"cache: {n} samples, {n // args.shard_samples} shards of {args.shard_samples}")
    v2, v1 = sizes["v2_bytes_per_sample"], sizes["v1_bytes_per_sample"]
    print(f"index bytes per sample: format 2 {v2:.1f}, format 1 {v1:.1f} (ratio {v2 / v1:.3f})")
    if "old_manifest_read_s" in coordinator:
        print(
            "older manifest (inline JSON sample list) read: "
            f"{coordinator['old_manifest_read_s']:.2f} s"
        )
    print(
        f"index snapshot write (coordinator): {coordinator['snapshot_write_s']:.2f} s from "
        f"scratch, {coordinator['snapshot_rewrite_s']:.2f} s with a valid snapshot there"
    )
    snap_s, full_s = mem["index_load_s"], full["index_load_s"]
    print(
        f"index load (fresh process): {snap_s:.2f} s from the snapshot, {full_s:.2f} s reading "
        f"every entry (ratio {snap_s / full_s:.3f}); CacheDataset on top: {mem['dataset_s']:.2f} s"
    )
    quick_s, slow_s = quick_check["check_s"], full_check["check_s"]
    print(
        f"preprocess rerun's cache check: {quick_s:.2f} s from the snapshot, {slow_s:.2f} s "
        f"reading every entry (ratio {quick_s / slow_s:.3f}); same report "
        f"{quick_check['report'] == full_check['report']} {quick_check['report']}"
    )
    for name, m in (("snapshot", mem), ("every entry", full)):
        print(
            f"memory per cached sample ({name}): store {m['store_bytes_per_sample']:.1f} B, "
            f"store + CacheDataset {m['bytes_per_sample']:.1f} B (goal <= 200)"
        )
    same = all(full[k] == mem[k] for k in ("samples", "groups", "stats_groups", "keys_hash"))
    print(f"snapshot index == index read from every entry: {same}")
    print(f"groups: {mem['groups']}; stats().groups: {mem['stats_groups']}")
    for name, r in (("manifest keys", manifest), ("samples file", from_file), ("torchrun", runs)):
        if r is None:
            continue
        print(
            f"start-up to first batch ({name}): {r['to_first_batch_s']:.2f} s after process "
            f"start ({r['imports_s']:.2f} s imports), {r['from_spawn_s']:.2f} s from spawn; "
            f"rss {r['rss_mb_at_first_batch']:.0f} MB (goal <= 10 s)"
        )


if __name__ == "__main__":
    main()
