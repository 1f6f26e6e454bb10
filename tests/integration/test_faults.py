"""Fault injection: each test breaks something for real and checks that nothing was lost.

Faults: a whole preprocess run (coordinator and workers) SIGKILLed; the S3 endpoint stopped
mid-write and restarted; two preprocess runs writing one cache at once; damaged or partly
deleted caches read by training; a whole training node (torchrun agent and its worker) killed.
(A killed preprocessing worker and a killed training rank: test_preprocess.py, test_train.py.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from splitstage.config.job import config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.demo.weight_files import build_demo_weights
from splitstage.process.torchrun import TorchrunError, free_port
from splitstage.splitter import UserError
from splitstage.storage.files import StorageError
from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.job_plan import make_plan, open_cache
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ENV = {"SPLITSTAGE_DEVICE": "cpu"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    write_digits_dataset(root / "data", limit=48)
    build_demo_weights(root / "weights")
    return root


def job(assets: Path, tmp: Path, name: str = "faults", cache: dict | None = None, **train):
    return config_from_dict(
        {
            "job": {"name": name, "seed": 1},
            "models": {
                "vae": {"weights": str(assets / "weights/vae.safetensors")},
                "dit": {"weights": str(assets / "weights/dit.safetensors")},
                "text_encoder": {"builder": "tiny"},
            },
            "trainable": {"lora_base_model": "dit", "lora_rank": 4},
            "data": {"base_path": str(assets / "data")},
            "cache": {"url": str(tmp / "cache"), "shard_samples": 8, **(cache or {})},
            "preprocess": {"batch_size": 4},
            "train": {"batch_size": 4, "max_steps": 6, "log_every": 1, "checkpoint_every": 2}
            | train,
            "output": {"url": str(tmp / "out")},
        }
    )


def assert_complete_and_consistent(config) -> CacheStore:
    """Every sample is committed exactly once and every committed shard verifies."""
    store = open_cache(make_plan(config))
    store.refresh()
    report = store.verify()
    assert report.ok, report.lines()
    stats = store.stats()
    assert stats.samples == 48, stats
    return store


PREPROCESS = (
    "import sys; from splitstage.config.job import SplitstageConfig; "
    "from splitstage.tasks.stage1.preprocess import preprocess; "
    "preprocess(SplitstageConfig.model_validate_json(open(sys.argv[1]).read()), "
    "workers=int(sys.argv[2]), progress=False)"
)


def start_preprocess(config, tmp: Path, workers: int, **env) -> subprocess.Popen:
    path = tmp / f"job-{time.time_ns()}.json"
    path.write_text(config.model_dump_json())
    return subprocess.Popen(
        [sys.executable, "-c", PREPROCESS, str(path), str(workers)],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        start_new_session=True,
    )


def test_whole_preprocess_run_killed_then_rerun_loses_nothing(assets, tmp_path):
    config = job(assets, tmp_path)
    # Each worker stops committing after its first shard: the kill lands mid-run however fast
    # the workers are (they could otherwise finish between two looks at the cache).
    proc = start_preprocess(config, tmp_path, workers=2, SPLITSTAGE_FAULT_PAUSE_AFTER_SHARDS="1")
    store = open_cache(make_plan(config))
    deadline = time.time() + 120
    while time.time() < deadline and not store.committed_keys():
        store.refresh()
        time.sleep(0.05)
    assert store.committed_keys(), "no shard was committed before the deadline"
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    store.refresh()
    before = store.committed_keys()
    assert 0 < len(before) < 48
    report = preprocess(config, workers=2, progress=False)
    assert report.reused == len(before) and report.computed == 48 - len(before)
    assert assert_complete_and_consistent(config).stats().duplicates == 0


def test_s3_endpoint_stopped_mid_write_fails_clearly_and_rerun_completes(
    assets, tmp_path, monkeypatch
):
    import s3fs
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    s3fs.S3FileSystem(key="key", secret="secret", client_kwargs={"endpoint_url": endpoint}).mkdir(
        "faults"
    )
    config = job(
        assets,
        tmp_path,
        cache={"url": "s3://faults/cache", "storage_options": {"endpoint_url": endpoint}},
    )
    real_write = CacheStore.write_shard
    calls = []

    def write_then_stop(self, samples):
        info = real_write(self, samples)
        calls.append(info)
        if len(calls) == 2:
            server.stop()  # the endpoint goes away between two shards
        return info

    monkeypatch.setattr(CacheStore, "write_shard", write_then_stop)
    try:
        with pytest.raises(StorageError, match="s3://faults/cache"):
            preprocess(config, workers=1, progress=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()  # same process: moto keeps what was written before the stop
        s3fs.S3FileSystem.clear_instance_cache()
        monkeypatch.setattr(CacheStore, "write_shard", real_write)
        report = preprocess(config, workers=1, progress=False)
        assert report.reused == 16 and report.computed == 32
        assert_complete_and_consistent(config)
    finally:
        server.stop()


def test_two_runs_writing_one_cache_at_once_both_finish_consistently(assets, tmp_path):
    config = job(assets, tmp_path)
    procs = [start_preprocess(config, tmp_path, workers=1) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    store = assert_complete_and_consistent(config)
    reader_view = store.read_samples(sorted(store.committed_keys()))
    assert len(reader_view) == 48


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete an index entry"])
def test_damaged_cache_is_named_and_never_trained_on(assets, tmp_path, damage):
    config = job(assets, tmp_path, name=f"damaged-{damage.split()[0]}")
    preprocess(config, workers=1, progress=False)
    store = open_cache(make_plan(config))
    shard = sorted(Path(store.root).glob("shards/*.safetensors"))[0]
    if damage == "flip a byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        expected = shard.name
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
        expected = shard.name
    else:
        (Path(store.root) / "index" / f"{shard.stem}.json").unlink()
        expected = "samples are not cached"  # found before launch: the manifest lists them
    # One line naming the damage (found by a rank, or before launch), never trained on.
    with pytest.raises(UserError, match=expected):
        train(config, run_root=tmp_path / "runs", env=ENV, on_line=lambda line: None)
    assert not (tmp_path / "out" / config.job.name / "dit_lora.safetensors").exists()


def test_whole_node_killed_then_both_resume_to_the_uninterrupted_result(assets, tmp_path):
    base = job(assets, tmp_path, name="node-ref", nnodes=2, max_steps=8, checkpoint_every=2)
    preprocess(base, workers=1, progress=False)

    def two_nodes(config, fault_env: dict | None = None):
        config.train.rdzv_endpoint = f"127.0.0.1:{free_port()}"
        reports, errors = {}, {}

        def node(rank: int) -> None:
            env = {**ENV, **(fault_env or {})}
            try:
                reports[rank] = train(
                    config,
                    node_rank=rank,
                    run_root=tmp_path / f"runs{rank}",
                    env=env,
                    on_line=lambda line: None,
                    timeout=600,
                )
            except TorchrunError as error:
                errors[rank] = error

        threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return reports, errors

    reference, errors = two_nodes(base)
    assert not errors
    crash = base.model_copy(deep=True)
    crash.job.name = "node-crash"
    # After update 3, global rank 1 SIGKILLs its node's torchrun agent and then itself.
    _, errors = two_nodes(crash, fault_env={"SPLITSTAGE_FAULT_KILL": "1:3:node"})
    assert set(errors) == {0, 1}  # one node died; the other lost its peer
    resumed, errors = two_nodes(crash)
    assert not errors
    # c10d may give global rank 0 (the one that reports) to either node.
    reference_report = next(r for r in reference.values() if r.losses)
    resumed_report = next(r for r in resumed.values() if r.losses)
    assert resumed_report.losses == reference_report.losses
    ref_w = load_file(reference_report.outputs["dit"])
    new_w = load_file(resumed_report.outputs["dit"])
    assert ref_w.keys() == new_w.keys()
    for key in ref_w:
        assert (ref_w[key] == new_w[key]).all(), key


def test_preprocess_runs_in_separate_caches_leave_no_temp_files(assets, tmp_path):
    config = job(assets, tmp_path)
    preprocess(config, workers=2, progress=False)
    leftovers = [p for p in Path(tmp_path / "cache").rglob("*") if ".tmp" in p.name]
    assert not leftovers
    shutil.rmtree(tmp_path / "cache")
