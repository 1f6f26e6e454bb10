"""Integration fixtures for the flows: one Prefect test server per session, tiny jobs on disk."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

PREFECT_TEST_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry calls from a test server
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A temporary Prefect server and database for the whole session (~20 s to start).

    PREFECT_HOME points into the session's temp dir, so test runs never land in the user's
    dashboard or database.
    """
    from prefect.settings import PREFECT_HOME, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect-home")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**PREFECT_TEST_ENV, "PREFECT_HOME": str(home)}.items():
            mp.setenv(name, value)
        with (
            temporary_settings(updates={PREFECT_HOME: home}),
            prefect_test_harness(server_startup_timeout=120),
        ):
            yield


@pytest.fixture(scope="session")
def demo_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo VAE and DiT weight files, written once per session."""
    from splitstage.pipelines.demo.weight_files import build_demo_weights

    return build_demo_weights(tmp_path_factory.mktemp("weights"))


@pytest.fixture
def tiny_job(tmp_path: Path, demo_weights: dict[str, Path], monkeypatch: pytest.MonkeyPatch):
    """`make(name, samples, **groups)`: a tiny job config dict, its digits under tmp_path.

    The test runs in tmp_path, so training's run folders (runs/train/...) land there too.
    """
    monkeypatch.chdir(tmp_path)

    def make(name: str, samples: int, **overrides) -> dict:
        return tiny_job_config(tmp_path, demo_weights, name, samples, **overrides)

    return make


def tiny_job_config(
    root: Path, weights: dict[str, Path], name: str, samples: int, **overrides
) -> dict:
    """A job config dict for a tiny run: `samples` digits, tiny text encoder, 2 updates."""
    from splitstage.data.digits import write_digits_dataset

    data = root / "data"
    write_digits_dataset(data, limit=samples)
    config = {
        "job": {"name": name},
        "models": {
            "text_encoder": {"builder": "tiny"},
            "vae": {"weights": str(weights["vae"])},
            "dit": {"weights": str(weights["dit"])},
        },
        "trainable": {"full": ["dit"]},
        "data": {"base_path": str(data)},
        "cache": {"url": str(root / "cache"), "shard_samples": 8},
        "preprocess": {"batch_size": 8, "device": "cpu"},
        "train": {"batch_size": 4, "max_steps": 2, "log_every": 1, "checkpoint_every": 2},
        "output": {"url": str(root / "output")},
    }
    for group, values in overrides.items():
        config.setdefault(group, {}).update(values)
    return config
