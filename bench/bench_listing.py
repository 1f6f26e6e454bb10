"""Listing a flat prefix of many objects: one chain of pages (`fs.find`) vs key ranges listed
concurrently (`object_listing.list_concurrently`, what a data-set listing on S3 does), side by side.

Run: .venv/bin/python bench/bench_listing.py [--objects 12000] [--latency 0.1] [--rounds 3]

moto serves the objects (seeded through its backend, in its own process), first as it is, where
moto's CPU sets the pace (it renders every page in Python, and scans and sorts the whole bucket
for each request), then with every request held `--latency` seconds before moto answers it (a
sleep in front of its WSGI app, no CPU): the wait per request sets the pace, as with S3, whose
pages of 1,000 keys take tens to hundreds of milliseconds each. Both listings must find the same
files.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cache import _free_port  # noqa: E402

from splitstage.storage.object_listing import RANGE_KEYS, list_concurrently  # noqa: E402

ROOT = "bench/flat"


def name(i: int) -> str:
    return f"{i:08d}.png"


def serve(port: int, objects: int, latency: float) -> None:
    """A moto S3 server on loopback with `objects` tiny objects under ROOT, answering each request
    after `latency` s; serves until stdin ends."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.moto_server import threaded_moto_server as threaded
    from moto.s3.models import s3_backends

    class DelayedServer(threaded.ThreadedMotoServer):
        def _server_entry(self) -> None:  # moto's, with the sleep in front of its app
            app = threaded.DomainDispatcherApplication(threaded.create_backend_app)

            def delayed(environ, start_response):
                time.sleep(latency)
                return app(environ, start_response)

            handler = threaded.MotoRequestHandler
            self._server = threaded.make_server(
                self._ip_address, self._port, delayed, True, request_handler=handler
            )
            self._server_ready_event.set()
            self._server.serve_forever()

    server = DelayedServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    backend.create_bucket("bench", "us-east-1")
    for i in range(objects):
        backend.put_object("bench", f"flat/{name(i)}", b"x" * (i % 7))
    print("ready", flush=True)
    sys.stdin.read()
    server.stop()


def measure(objects: int, rounds: int, latency: float = 0.0) -> dict[str, float]:
    """Median seconds of each listing against a fresh seeded server (`latency` per request)."""
    import s3fs

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), str(objects), str(latency)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stdout is not None
        while (line := server.stdout.readline()) and line.strip() != "ready":
            pass
        if not line:
            raise RuntimeError("the seeded moto server did not start")
        endpoint = f"http://127.0.0.1:{port}"
        fs = s3fs.S3FileSystem(key="key", secret="secret", client_kwargs={"endpoint_url": endpoint})
        names = [name(i) for i in range(objects)]
        runs = {
            "one chain": lambda: fs.find(ROOT, detail=True),
            "key ranges": lambda: list_concurrently(fs, ROOT, [""], names),
        }
        times: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(rounds):  # interleaved, so load drift affects both alike
            counts = set()
            for label, run in runs.items():
                fs.invalidate_cache()
                start = time.perf_counter()
                counts.add(len(run()))
                times[label].append(time.perf_counter() - start)
            if counts != {objects}:
                raise RuntimeError(f"the listings disagree: {sorted(counts)} files")
        return {label: statistics.median(ts) for label, ts in times.items()}
    finally:
        server.terminate()
        server.wait(timeout=30)


def rows(title: str, got: dict[str, float]) -> list[str]:
    chain, ranges = got["one chain"], got["key ranges"]
    return [
        f"{title}: one chain {chain:.2f} s, key ranges {ranges:.2f} s, "
        f"ranges / chain = {ranges / chain:.3f}"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=12_000)
    parser.add_argument("--latency", type=float, default=0.1, help="s per request (0: skip)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(int(args.serve[0]), int(args.serve[1]), float(args.serve[2]))
        return 0
    print(
        f"listing {args.objects:,} objects in one flat prefix, {RANGE_KEYS:,} named keys per "
        f"range, median of {args.rounds} rounds"
    )
    local = measure(args.objects, args.rounds)
    print("\n".join(rows("moto as it is (its CPU bound)", local)), flush=True)
    FIGURES.update(cpu_bound_ratio=local["key ranges"] / local["one chain"])
    if args.latency:
        delayed = measure(args.objects, args.rounds, args.latency)
        print("\n".join(rows(f"moto + {args.latency * 1e3:.0f} ms per request", delayed)))
        FIGURES.update(latency_bound_ratio=delayed["key ranges"] / delayed["one chain"])
    return 0


FIGURES: dict[str, float] = {}  # the last run's figures, for bench/run_all.py


if __name__ == "__main__":
    sys.exit(main())
