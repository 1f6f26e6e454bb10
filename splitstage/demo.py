"""`make demo`: two-stage split training on the digits data set, end to end, with no server.

Run from the repository root:

    .venv/bin/python -m splitstage.demo          # what `make demo` runs
    .venv/bin/python -m splitstage.demo --limit 256   # a quicker run on the first 256 digits

It writes the digits data set (1,797 captioned 64x64 images) and the demo weights under runs/demo/
(once), then runs the `split-training` Prefect flow with configs/demo.toml: the real MiniLM text
encoder and the VAE run once per sample (stage 1, cached in runs/demo/cache), the DiT trains from
the cache (stage 2, torchrun). It prints progress, then the time per stage, the loss and where the
weights are. Run it again: the cache is reused (0 new samples) and a new weights version is
trained. Prefect runs in ephemeral mode (a temporary local server, state under .prefect/demo); with
a server up (`infra/stack.sh up` and its PREFECT_API_URL exported) the runs show in its UI.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = "configs/demo.toml"
ENV_DEFAULTS = {
    # Project-local Prefect state, so demo runs do not land in the user's ~/.prefect dashboard.
    "PREFECT_HOME": str(ROOT / ".prefect" / "demo"),
    # The temporary server takes 8-17 s to start on a busy 2-core machine; 20 s is not enough.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # Measured on 2 cores: one training rank at 2 OpenMP threads took 2-5 s per update, at 1
    # thread 0.22 s (preprocessing shards run as threads, one core each).
    "OMP_NUM_THREADS": "1",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m splitstage.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", default=DEMO_CONFIG, help="job config (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N digits")
    parser.add_argument(
        "--prepare-only", action="store_true", help="write the data set and weights, then stop"
    )
    return parser.parse_args(argv)


def write_demo_weights(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """The demo's weights: its autoencoder (encoder + decoder, trained on the digits in seconds,
    deterministically) and the DiT (a seeded init standing in for a pretrained file)."""
    from splitstage.pipelines.demo.weight_files import build_demo_weights

    return build_demo_weights(out_dir, seed=seed)


def prepare_inputs(config) -> None:
    """Write the digits data set and the demo weights where the config expects them (once)."""
    from splitstage.data.digits import write_digits_dataset

    data = Path(config.data.base_path)
    if not (data / "metadata.csv").is_file():
        print(f"writing the digits data set to {data} ...", flush=True)
        count = write_digits_dataset(data, size=config.pipeline.image_size)
        print(f"  {count} images", flush=True)
    missing = [
        m.weights for m in config.models.values() if m.weights and not Path(m.weights).exists()
    ]
    vae = config.models.get("vae")
    decoder = (
        Path(vae.weights).with_name("vae_decoder.safetensors") if vae and vae.weights else None
    )
    if decoder is not None and not decoder.exists():  # weights from before the autoencoder
        missing.append(str(decoder))
    if missing:
        folder = Path(missing[0]).parent
        print(f"writing demo weights to {folder} ...", flush=True)
        write_demo_weights(folder, seed=config.job.seed)


def print_summary(summary: dict, wall: float) -> None:
    """Time per stage, loss, cache figures and where the weights are."""
    seconds = summary["seconds"]
    loss = summary["final_loss"]
    print()
    print(f"split training of {summary['job']} finished: {wall:.1f} s wall (with Prefect start-up)")
    print(f"  plan        {seconds['plan']:7.1f} s")
    print(
        f"  preprocess  {seconds['preprocess']:7.1f} s  {summary['samples']} samples: "
        f"{summary['samples_new']} new, {summary['samples_reused']} reused from the cache"
    )
    loss_text = f"final loss {loss:.4f}" if loss is not None else "no updates"
    print(f"  train       {seconds['train']:7.1f} s  {summary['updates']} updates, {loss_text}")
    print(f"  flow total  {seconds['total']:7.1f} s")
    print(f"cache:   {summary['cache_url']}")
    for name, url in summary["weights"].items():
        print(f"weights: {url}  ({name})")
    grids = summary.get("sample_grids") or {}
    if grids:
        last = max(grids, key=int)
        print(f"samples: {grids[last]}  (update {last}; {len(grids)} grids in that folder)")
    print(f"latest:  {summary['latest']}")


def main(argv: list[str] | None = None) -> int:
    """Prepare the inputs, run the split-training flow, print the summary."""
    args = parse_args(argv)
    started = time.perf_counter()
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect makes one level
    os.chdir(ROOT)  # the demo config's paths are relative to the repository root
    from splitstage.config.job import ConfigError, load_config
    from splitstage.splitter import UserError

    try:
        config = load_config(args.config)
        if args.limit is not None:
            config.data.limit = args.limit
        prepare_inputs(config)
        if args.prepare_only:
            return 0
        from splitstage.flows.split_training import split_training

        summary = split_training(config)
    except (ConfigError, UserError) as error:
        print(f"demo: error: {error}", file=sys.stderr)
        return 2
    print_summary(summary, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    from splitstage.process.leaving import run_then_leave

    run_then_leave(main)
