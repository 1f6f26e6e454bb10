"""Run leases against real crashes: a SIGKILLed holder, on a local folder and on S3 (moto)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import splitstage.storage.lease as lease_module
from splitstage.storage.files import StorageError
from splitstage.storage.lease import RunLease, RunLeaseHeldError, hold_run, read_lease

pytestmark = pytest.mark.slow

TTL = 2.0
HOLDER = """
import json, sys, time
from splitstage.storage.files import StorageError
from splitstage.storage.lease import hold_run
with hold_run(sys.argv[1], json.loads(sys.argv[2]), ttl=float(sys.argv[3])):
    print("held", flush=True)
    time.sleep(120)
"""


def start_holder(url: str, options: dict | None) -> subprocess.Popen:
    """A real process holding the lease on `url` (ttl TTL), returned once it holds it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, json.dumps(options), str(TTL)],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.strip() == "held", f"holder did not start (exit {proc.poll()})"
    return proc


def kill(proc: subprocess.Popen) -> float:
    """SIGKILL `proc` (no cleanup runs), reap it; return the kill time."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    return time.monotonic()


def wait_for_takeover(url: str, options: dict | None, killed_at: float) -> float:
    """Acquire as soon as the lease expires; refused until then. Return seconds after the kill."""
    refusals = 0
    while True:
        try:
            lease = RunLease(url, options, ttl=TTL).acquire()
        except RunLeaseHeldError as error:
            assert "if that process is dead the lease expires in" in str(error)
            refusals += 1
            assert time.monotonic() - killed_at < TTL + 5, "the dead holder's lease never expired"
            time.sleep(0.1)
            continue
        lease.release()
        assert refusals > 0, "the lease of the killed holder was not refused while fresh"
        return time.monotonic() - killed_at


@pytest.fixture
def other_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this test process look like another machine, so the holder's pid is not checked."""
    monkeypatch.setattr(lease_module, "_MACHINE", "another-machine")


def test_killed_local_holder_blocks_until_its_lease_expires(tmp_path: Path, other_machine) -> None:
    url = str(tmp_path / "run")
    holder = start_holder(url, None)
    waited = wait_for_takeover(url, None, kill(holder))
    print(f"local: taken over {waited:.2f} s after SIGKILL (ttl {TTL} s)")
    assert TTL / 2 < waited < TTL + 1.5  # it renewed about ttl/3 s before dying at the latest


def test_killed_local_holder_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    killed_at = kill(start_holder(url, None))
    with hold_run(url, ttl=TTL):
        waited = time.monotonic() - killed_at
    print(f"local, same host: taken over {waited:.3f} s after SIGKILL")
    assert waited < TTL / 2


def test_stopped_local_holder_keeps_the_run_past_its_ttl(tmp_path: Path) -> None:
    # SIGSTOP: alive, not renewing; its flock keeps the run until it dies (then taken at once)
    url = str(tmp_path / "run")
    holder = start_holder(url, None)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        time.sleep(TTL + 0.5)
        with pytest.raises(RunLeaseHeldError, match=f"pid {holder.pid}.*may be stopped or hung"):
            RunLease(url, ttl=TTL).acquire()
    finally:
        killed_at = kill(holder)
    with hold_run(url, ttl=TTL):
        assert time.monotonic() - killed_at < TTL / 2


def test_killed_s3_holder_blocks_until_its_lease_expires(s3_bucket, other_machine) -> None:
    url, options = s3_bucket
    url = f"{url}/run"
    holder = start_holder(url, options)
    waited = wait_for_takeover(url, options, kill(holder))
    print(f"s3: taken over {waited:.2f} s after SIGKILL (ttl {TTL} s, 1 s timestamps)")
    assert TTL / 2 < waited < TTL + 3.5  # whole-second LastModified/Date, one second of margin


def test_s3_lease_refuses_renews_detects_loss_and_releases_only_its_own(s3_bucket) -> None:
    url, options = s3_bucket
    url = f"{url}/run"
    reasons: list[str] = []
    started = time.monotonic()
    with hold_run(url, options, ttl=TTL, on_lost=reasons.append) as lease:
        acquired = time.monotonic() - started
        assert lease._store.conditional  # moto enforces If-None-Match (the probe was refused)
        with pytest.raises(RunLeaseHeldError, match=r"pid \d+.*expires in [23] s"):
            RunLease(url, options, ttl=TTL).acquire()
        first = lease.info.renewed
        time.sleep(1.5)
        assert read_lease(url, options).renewed > first  # renewed in the background
        other = RunLease(url, options, ttl=TTL)
        other._store.takeover(other_info(lease.info).to_bytes(), other._store.read().tag)
        deadline = time.monotonic() + 3
        while not reasons and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reasons and "belongs to host intruder" in reasons[0]
    assert read_lease(url, options).host == "intruder"  # release left the other lease alone
    print(f"s3: acquire (with 0.5 s read-back) took {acquired:.2f} s")


def other_info(info: lease_module.LeaseInfo) -> lease_module.LeaseInfo:
    """A lease of another holder on another host."""
    return lease_module.LeaseInfo("intruder-token", "intruder", "m", 1, 0.0, 0.0, 0.0, info.ttl)


def s3_racer(url: str, options: dict, barrier: threading.Barrier, outcomes: list) -> None:
    """One racing acquirer (a thread); appends its lease or its refusal."""
    lease = RunLease(url, options, ttl=30, settle=0.3)
    barrier.wait(10)
    try:
        outcomes.append(lease.acquire())
    except RunLeaseHeldError as error:
        outcomes.append(error)


def test_s3_racing_acquirers_exactly_one_wins(s3_bucket) -> None:
    url, options = s3_bucket
    for round_ in range(3):
        run, barrier, outcomes = f"{url}/race-{round_}", threading.Barrier(2), []
        threads = [
            threading.Thread(target=s3_racer, args=(run, options, barrier, outcomes)) for _ in "ab"
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        wins = [o for o in outcomes if isinstance(o, RunLease)]
        assert len(wins) == 1 and len(outcomes) == 2, f"round {round_}: {outcomes}"
        wins[0].release()
        assert read_lease(run, options) is None


def test_s3_missing_bucket_is_a_storage_error(s3_bucket) -> None:
    _, options = s3_bucket
    with pytest.raises(StorageError, match="does not exist"):
        RunLease("s3://no-such-bucket/run", options).acquire()
