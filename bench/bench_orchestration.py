"""Prefect orchestration overhead as a share of the demo's wall time, measured side by side.

    .venv/bin/python bench/bench_orchestration.py               # the whole demo job (~3 min)
    .venv/bin/python bench/bench_orchestration.py --limit 256   # quicker, noisier

In one process, from empty caches, the demo job (configs/demo.toml) runs as the plain functions
(plan, index, shards in threads, summary, torchrun training) and as the `split-training` flow
(ephemeral Prefect server, started once and timed on its own). `--repeat 2` runs plain, flow, flow,
plain to cancel warm-up effects. Prints seconds per stage and the ratio flow / plain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splitstage.demo import ENV_DEFAULTS  # noqa: E402  (sets nothing on import)

STAGES = ("plan", "preprocess", "train", "total")


def with_storage(config, folder: Path):
    """The config with its cache and outputs in `folder` (an empty cache each run)."""
    data = config.model_dump()
    data["cache"]["url"] = str(folder / "cache")
    data["output"]["url"] = str(folder / "output")
    return type(config).model_validate(data)


def run_plain(config) -> dict[str, float]:
    """The pipeline as plain function calls, with the same shard threads as the flow."""
    from splitstage.data.index import index_data_set
    from splitstage.tasks.job_plan import make_plan
    from splitstage.tasks.launch.launcher import train
    from splitstage.tasks.stage1.preprocess import (
        CacheSnapshot,
        preprocess_shard,
        summarize_preprocess,
    )

    seconds: dict[str, float] = {}
    started = time.perf_counter()
    plan = make_plan(config)
    _ = plan.cache_key
    seconds["plan"] = time.perf_counter() - started
    mark = time.perf_counter()
    data = index_data_set(config)
    store = plan.cache  # the process's one store, as the flow's
    stats = store.stats()
    before = CacheSnapshot(frozenset(store.committed_keys()), stats.shards, stats.bytes)
    shards = config.preprocess.workers
    reports = [None] * shards

    def shard(i: int) -> None:
        reports[i] = preprocess_shard(config, i, shards, plan=plan, data=data, progress=False)

    threads = [threading.Thread(target=shard, args=(i,)) for i in range(shards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    summarize_preprocess(plan, data, reports, before, shards)
    seconds["preprocess"] = time.perf_counter() - mark
    mark = time.perf_counter()
    train(config, run_id="bench-plain", on_line=lambda line: None)
    seconds["train"] = time.perf_counter() - mark
    seconds["total"] = time.perf_counter() - started
    return seconds


def run_flow(config) -> dict[str, float]:
    """The split-training flow; its stage times come from the flow's summary."""
    from splitstage.flows.split_training import split_training

    started = time.perf_counter()
    summary = split_training(config)
    seconds = {k: summary["seconds"][k] for k in ("plan", "preprocess", "train")}
    seconds["total"] = time.perf_counter() - started
    return seconds


def server_cpu_seconds() -> float:
    """CPU time used so far by the ephemeral server (a child process of this one)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            if "prefect.server" in " ".join(child.cmdline()):
                times = child.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
    return total


def start_server() -> float:
    """Start the ephemeral Prefect server (what the first flow run in a process pays)."""
    from prefect import get_client

    started = time.perf_counter()
    with get_client(sync_client=True) as client:
        client.api_healthcheck()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    """Run both ways, print the side-by-side table and the overhead ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo.toml")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N digits")
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs (ABBA order)")
    args = parser.parse_args(argv)
    for name, value in {**ENV_DEFAULTS, "PREFECT_HOME": str(ROOT / ".prefect" / "bench")}.items():
        os.environ.setdefault(name, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.chdir(ROOT)
    from splitstage.config.job import load_config
    from splitstage.demo import prepare_inputs

    config = load_config(args.config)
    if args.limit:
        config.data.limit = args.limit
    prepare_inputs(config)
    results: dict[str, list[dict[str, float]]] = {"plain": [], "flow": []}
    server = None
    order = []
    for i in range(args.repeat):
        order += ["plain", "flow"] if i % 2 == 0 else ["flow", "plain"]
    with tempfile.TemporaryDirectory(prefix="bench-orchestration-") as tmp:
        for n, kind in enumerate(order):
            run_config = with_storage(config, Path(tmp) / f"{kind}-{n}")
            if kind == "flow" and server is None:
                server = start_server()
            print(f"run {n + 1}/{len(order)}: {kind} ...", flush=True)
            cpu = server_cpu_seconds()
            results[kind].append((run_plain if kind == "plain" else run_flow)(run_config))
            results[kind][-1]["server_cpu"] = server_cpu_seconds() - cpu
    mean = {k: {s: statistics.mean(r[s] for r in v) for s in STAGES} for k, v in results.items()}
    samples = config.data.limit or "all"
    print(f"\n{config.job.name}: {samples} samples, {args.repeat} run(s) each way (mean seconds)")
    print(f"{'stage':<12}{'plain':>10}{'flow':>10}")
    for stage in STAGES:
        print(f"{stage:<12}{mean['plain'][stage]:>10.2f}{mean['flow'][stage]:>10.2f}")
    plain, flow = mean["plain"]["total"], mean["flow"]["total"]
    print(f"ephemeral Prefect server start-up: {server:.2f} s (once per process)")
    cpu = {k: statistics.mean(r["server_cpu"] for r in v) for k, v in results.items()}
    print(
        f"server CPU during a run: {cpu['flow']:.2f} s with the flow, {cpu['plain']:.2f} s "
        f"idle (it shares the cores with the work)"
    )
    print(
        f"orchestration overhead: {flow - plain:+.2f} s per run = "
        f"{100 * (flow - plain) / plain:+.1f}% of the plain wall time; "
        f"ratio flow/plain = {flow / plain:.3f} ({(flow + server) / plain:.3f} with start-up)"
    )
    FIGURES.update(overhead_share=(flow - plain) / flow, ratio=flow / plain, startup_s=server)
    return 0


FIGURES: dict[str, float] = {}  # the last run's figures, for bench/run_all.py


if __name__ == "__main__":
    sys.exit(main())
