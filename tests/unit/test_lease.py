"""Run leases on local folders and memory://: refusal, takeover, renewal, loss, real races."""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import filelock
import pytest

import splitstage.storage.lease as lease_module
from splitstage.process import liveness
from splitstage.splitter import UserError
from splitstage.storage.lease import (
    LEASE_NAME,
    LeaseInfo,
    RunLease,
    RunLeaseHeldError,
    hold_run,
    read_lease,
)


def write_foreign(
    run: Path,
    *,
    age: float = 0.0,
    machine: str = "elsewhere",
    pid: int = 4242,
    pid_started: float = 0.0,
    ttl: float = 60.0,
) -> LeaseInfo:
    """Put another holder's lease in `run`, last renewed `age` s ago."""
    when = time.time() - age
    info = LeaseInfo(uuid.uuid4().hex, "otherhost", machine, pid, pid_started, when, when, ttl)
    run.mkdir(parents=True, exist_ok=True)
    path = run / LEASE_NAME
    path.write_bytes(info.to_bytes())
    os.utime(path, (when, when))
    return info


def test_acquire_writes_the_lease_and_release_removes_it(tmp_path: Path) -> None:
    run = tmp_path / "out" / "run-1"  # the folder does not exist yet
    with hold_run(str(run), ttl=30) as lease:
        info = read_lease(str(run))
        assert lease.lost is None and info == lease.info
        assert (info.host, info.pid, info.ttl) == (socket.gethostname(), os.getpid(), 30.0)
    assert not (run / LEASE_NAME).exists()
    assert os.listdir(run) == []  # no temp files left behind
    assert lease.info is None and lease.lost is None


def test_second_acquire_is_refused_with_one_line_naming_the_holder(tmp_path: Path) -> None:
    with hold_run(str(tmp_path), ttl=60), pytest.raises(RunLeaseHeldError) as caught:
        RunLease(str(tmp_path), ttl=60).acquire()
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message
    for part in (
        f"run {tmp_path} is held",
        f"host {socket.gethostname()}, pid {os.getpid()}, started 20",
        "lease renewed 0 s ago",
        "wait for it to finish",
        "if that process is dead the lease expires in 60 s",
        "or give another --run-id.",
    ):
        assert part in message


def test_fresh_lease_of_another_machine_is_refused(tmp_path: Path) -> None:
    write_foreign(tmp_path, age=10, ttl=60)
    with pytest.raises(RunLeaseHeldError, match=r"host otherhost, pid 4242.*expires in 50 s"):
        RunLease(str(tmp_path)).acquire()


def test_stale_lease_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_foreign(tmp_path, age=120, ttl=60)
    with caplog.at_level(logging.WARNING), hold_run(str(tmp_path)) as lease:
        assert read_lease(str(tmp_path)).holder == lease.info.holder
    assert "last renewed it 120 s ago, more than its ttl of 60 s" in caplog.text


def test_dead_pid_on_this_host_is_taken_over_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    write_foreign(tmp_path, machine=lease_module._MACHINE, pid=child.pid, age=0)
    with caplog.at_level(logging.WARNING), hold_run(str(tmp_path)) as lease:
        assert lease.lost is None and read_lease(str(tmp_path)).holder == lease.info.holder
    assert f"pid {child.pid}" in caplog.text and "no longer running on this host" in caplog.text


def test_live_pid_on_this_host_is_refused_but_a_reused_pid_is_not(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = liveness.process_started(child.pid)
        write_foreign(tmp_path, machine=lease_module._MACHINE, pid=child.pid, pid_started=started)
        with pytest.raises(RunLeaseHeldError, match=f"pid {child.pid}"):
            RunLease(str(tmp_path)).acquire()
        # same pid, other start time: the pid was reused by an unrelated process
        write_foreign(
            tmp_path, machine=lease_module._MACHINE, pid=child.pid, pid_started=started - 100
        )
        with hold_run(str(tmp_path)) as lease:
            assert lease.lost is None and read_lease(str(tmp_path)).holder == lease.info.holder
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux /proc only")
def test_machine_and_process_start_do_not_move_with_the_wall_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the kernel's boot time (hence psutil's create times) moves when NTP steps or slews the
    # clock; a holder and a checker of one boot must still agree on the machine and the start
    script = "from splitstage.process import liveness as l; print(l.machine_id())"
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    machine = child.stdout.strip()
    here = liveness.machine_id(), liveness.process_started(os.getpid())
    monkeypatch.setattr(liveness.psutil, "boot_time", lambda: 1.0e9)  # the clock stepped
    assert (liveness.machine_id(), liveness.process_started(os.getpid())) == here
    assert machine == here[0]
    with open("/proc/sys/kernel/random/boot_id") as file:
        assert file.read().strip() in here[0]


def test_a_process_start_is_the_same_seen_from_inside_and_outside() -> None:
    script = "import os, time; from splitstage.process import liveness as l"
    script += "; print(l.process_started(os.getpid()), flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        inside = float(child.stdout.readline())
        assert liveness.process_started(child.pid) == inside
        assert not liveness.process_gone(child.pid, inside)
        assert liveness.process_gone(child.pid, inside - 100)  # another process with that pid
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert liveness.process_gone(child.pid, inside)


def test_renewal_keeps_the_lease_fresh(tmp_path: Path) -> None:
    path = tmp_path / LEASE_NAME
    with hold_run(str(tmp_path), ttl=0.9) as lease:
        first = lease.info.renewed
        ages = []
        for _ in range(12):  # 2.4 s: more than two ttls
            time.sleep(0.2)
            ages.append(time.time() - path.stat().st_mtime)
        assert max(ages) < 0.9  # renewed every 0.3 s: never old enough to be taken over
        assert read_lease(str(tmp_path)).renewed > first + 1.5
        with pytest.raises(RunLeaseHeldError):
            RunLease(str(tmp_path), ttl=0.9).acquire()
        assert lease.lost is None and read_lease(str(tmp_path)).holder == lease.info.holder


def wait_for(predicate, timeout: float = 5.0) -> bool:
    """Poll `predicate` every 20 ms until it is true or `timeout` s passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_lost_lease_is_reported_by_the_renewer(tmp_path: Path) -> None:
    reasons: list[str] = []
    with hold_run(str(tmp_path), ttl=0.6, on_lost=reasons.append) as lease:
        assert lease.lost is None
        other = write_foreign(tmp_path)
        assert wait_for(lambda: reasons, timeout=2.0)
        assert "the lease now belongs to host otherhost, pid 4242" in lease.lost
        assert lease.renew() is False  # a lost lease is never renewed again
    assert reasons == [lease.lost]  # reported once
    assert read_lease(str(tmp_path)).holder == other.holder  # left in place


def test_deleted_lease_is_reported(tmp_path: Path) -> None:
    lost = threading.Event()
    with hold_run(str(tmp_path), ttl=0.6, on_lost=lambda _: lost.set()) as lease:
        (tmp_path / LEASE_NAME).unlink()
        assert lost.wait(2.0)
        assert "nobody (it was deleted)" in lease.lost


def test_deleted_lock_file_is_a_lost_lease(tmp_path: Path) -> None:
    # with its lock file gone, a second run could flock a new one: the holder must know
    reasons: list[str] = []
    with hold_run(str(tmp_path), ttl=0.6, on_lost=reasons.append) as lease:
        (tmp_path / f"{LEASE_NAME}.lock").unlink()
        assert wait_for(lambda: reasons, timeout=2.0)
        assert f"{LEASE_NAME}.lock was deleted or replaced" in lease.lost
    assert reasons == [lease.lost] and os.listdir(tmp_path) == []  # lease removed, lock not ours


def test_a_flock_holder_is_never_taken_over_even_with_a_stale_lease(tmp_path: Path) -> None:
    # a live process holding the flock (stopped, hung) keeps the run however old its lease
    write_foreign(tmp_path, age=120, ttl=60)
    holder = filelock.FileLock(str(tmp_path / f"{LEASE_NAME}.lock"), thread_local=False)
    with holder, pytest.raises(RunLeaseHeldError) as caught:
        RunLease(str(tmp_path), ttl=60).acquire()
    message = str(caught.value)
    assert "\n" not in message and "host otherhost, pid 4242" in message
    assert "lease renewed 12" in message and "may be stopped or hung" in message  # 120-121 s
    with hold_run(str(tmp_path)) as lease:  # its flock released: the stale lease is taken over
        assert read_lease(str(tmp_path)).holder == lease.info.holder


def test_renewal_failures_are_reported_once_the_ttl_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reasons: list[str] = []
    with hold_run(str(tmp_path), ttl=0.6, on_lost=reasons.append) as lease:

        def broken():
            raise OSError("disk went away")

        monkeypatch.setattr(lease._store, "read", broken)
        assert wait_for(lambda: reasons, timeout=3.0)
        monkeypatch.undo()
    assert "could not renew it for" in reasons[0] and "disk went away" in reasons[0]


def test_release_does_not_delete_someone_elses_lease(tmp_path: Path) -> None:
    lease = RunLease(str(tmp_path), ttl=60).acquire()
    other = write_foreign(tmp_path)
    lease.release()
    assert read_lease(str(tmp_path)).holder == other.holder
    assert sorted(os.listdir(tmp_path)) == [LEASE_NAME]


def test_unreadable_lease_is_refused_while_fresh_then_taken_over(tmp_path: Path) -> None:
    path = tmp_path / LEASE_NAME
    path.write_bytes(b'{"holder": ')  # a partial or foreign file
    with pytest.raises(RunLeaseHeldError, match="unreadable lease"):
        RunLease(str(tmp_path), ttl=60).acquire()
    os.utime(path, (time.time() - 61, time.time() - 61))
    with hold_run(str(tmp_path), ttl=60) as lease:
        assert read_lease(str(tmp_path)).holder == lease.info.holder


def test_memory_filesystem_uses_the_generic_store() -> None:
    url = f"memory://leases/{uuid.uuid4().hex}"
    with hold_run(url, ttl=30, settle=0) as lease:
        assert type(lease._store).__name__ == "_ObjectStore"
        with pytest.raises(RunLeaseHeldError):
            RunLease(url, settle=0).acquire()
    assert read_lease(url) is None


def test_bad_ttl_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ttl"):
        RunLease(str(tmp_path), ttl=0)


def _race(url: str, barrier, results, done) -> None:
    """One racer: acquire at the barrier, report, hold until the parent says done."""
    barrier.wait(10)
    try:
        lease = RunLease(url, ttl=30).acquire()
    except RunLeaseHeldError:
        results.put(False)
        return
    results.put(True)
    done.wait(10)
    lease.release()


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_two_processes_racing_exactly_one_wins(tmp_path: Path, stale: bool) -> None:
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    for round_ in range(20):
        run = tmp_path / f"round-{round_}"
        if stale:
            write_foreign(run, age=120, ttl=60)
        barrier, results, done = ctx.Barrier(2), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_race, args=(str(run), barrier, results, done)) for _ in "ab"]
        for proc in procs:
            proc.start()
        outcomes = sorted(results.get(timeout=20) for _ in procs)
        done.set()
        for proc in procs:
            proc.join(20)
        assert outcomes == [False, True], f"round {round_}: {outcomes}"
        assert [p.exitcode for p in procs] == [0, 0]
        assert os.listdir(run) == []  # the winner released; no temp files left
