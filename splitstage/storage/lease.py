"""Run leases: one `splitstage train` per run at a time, even after its holder crashed.

`<run_url>/LEASE.json` names its holder; a thread renews it every ttl/3 s. A lease unrenewed for
its ttl is taken over; one whose holder process is gone from this machine (boot, PID namespace,
process start time) at once. Ages: S3 compares LastModified with the response's Date (server
clock, whole seconds: one is subtracted); a folder its mtime, other filesystems the holder's
`renewed` time, against this host's clock (keep hosts in sync: NTP).

Folder (local or shared disk): the holder also holds a `filelock` flock on `LEASE.json.lock` for
the whole run; the kernel drops it when the process dies (filelock closes it in forked children).
A live holder, stopped or hung too, is never taken over by a process its flock reaches (this host,
NFS clients). Hosts that flocks do not reach (a disk without shared locks) judge LEASE.json as
above; it is written check-then-replace under the flock, so a holder of such a host paused past its
ttl may overwrite its successor, whose renewer reports the loss. The lock file is removed at
release while still held (filelock drops a flock won on a removed file); one deleted or replaced
mid-run is a lost lease.
s3://: PutObject `If-None-Match: *` creates, `If-Match: <ETag>` takes over and renews, DeleteObject
`If-Match` releases (AWS S3, MinIO, moto 5.2.5 + s3fs 2026.9.0 enforce them); acquire reads back
after `settle` s (moto checks without a lock) and probes that a second conditional create fails.
Stores ignoring conditions, and other filesystems, get check-then-write + read-back: two runs can
both win if one stalls over `settle` s between check and write.
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import filelock
from fsspec.asyn import sync

from splitstage.process import liveness
from splitstage.splitter import UserError
from splitstage.storage import files as storage

LEASE_NAME = "LEASE.json"  # in each leased place: who holds the run

log = logging.getLogger(__name__)

FORMAT = "splitstage-run-lease/2"  # /2: pid_started in seconds since boot (Linux)
_FAILED = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"}  # condition not met


class RunLeaseHeldError(UserError):
    """Another live process holds the run's lease: a second run would destroy its files."""


@dataclass(frozen=True)
class LeaseInfo:
    """What a lease says: who holds the run, since when, and how long it lives unrenewed."""

    holder: str
    host: str
    machine: str
    pid: int
    pid_started: float
    started: float
    renewed: float
    ttl: float
    format: str = FORMAT

    def to_bytes(self) -> bytes:
        """The lease as JSON bytes."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> LeaseInfo | None:
        """The lease in `data`, or None when it is not one of this format (partial, foreign)."""
        try:
            raw = json.loads(data)
            info = cls(**{name: raw[name] for name in cls.__dataclass_fields__})
            float(info.pid + info.pid_started + info.started + info.renewed + info.ttl)
        except (ValueError, KeyError, TypeError):
            return None
        return info if info.format == FORMAT else None

    def who(self) -> str:
        """Host, pid and start time, for messages."""
        started = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(self.started))
        return f"host {self.host}, pid {self.pid}, started {started}"


class _Seen(NamedTuple):
    """One read of the lease: parsed (None: unreadable), version tag, age by the storage clock."""

    info: LeaseInfo | None
    tag: str
    age: float


def _seen(data: bytes, age: float, tag: str | None = None) -> _Seen:
    """A read of `data`; the tag defaults to its sha256 (S3 passes the ETag)."""
    return _Seen(LeaseInfo.parse(data), tag or hashlib.sha256(data).hexdigest(), max(0.0, age))


def _ours(seen: _Seen | None, holder: str) -> bool:
    """True when `seen` is a lease of `holder`."""
    return seen is not None and seen.info is not None and seen.info.holder == holder


_MACHINE = liveness.machine_id()


def _holder_dead(info: LeaseInfo) -> bool:
    """True when the holder ran on this machine and its process is gone (or its pid was reused)."""
    return info.machine == _MACHINE and liveness.process_gone(info.pid, info.pid_started)


class _ObjectStore:
    """Any fsspec filesystem: check, then write; acquire reads back after `settle` s."""

    lock_path = ""  # folders: the flocked file

    def __init__(self, fs: Any, path: str, settle: float) -> None:
        self.fs, self.path, self.settle = fs, path, settle

    def hold(self) -> bool:
        """Take the store's lock for the run (folders: a flock); False while another holds it."""
        return True

    def lock_lost(self) -> str | None:
        """Why the held lock is no longer ours (its file deleted or replaced), else None."""
        return None

    def unhold(self) -> None:
        """Give the lock back (a no-op when not held)."""

    def read(self) -> _Seen | None:
        try:
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        info = LeaseInfo.parse(data)  # an unreadable object is foreign (puts are atomic): stale
        return _seen(data, time.time() - info.renewed if info else math.inf)

    def takeover(self, data: bytes, tag: str | None) -> bool:
        """Write `data` if the lease there now has version `tag` (None: if there is none)."""
        current = self.read()
        if (current.tag if current else None) != tag:
            return False
        storage.write_atomic(self.fs, self.path, data)
        return True

    def create(self, data: bytes) -> bool:
        return self.takeover(data, None)

    renew = takeover

    def delete(self, tag: str) -> None:
        current = self.read()
        if current is not None and current.tag == tag:
            self.fs.rm_file(self.path)


class _LocalStore(_ObjectStore):
    """Folder: a flock (filelock) on `LEASE.json.lock` held while the run lives; LEASE.json beside
    it is written check-then-replace (atomic rename) under it, and its mtime is its age."""

    def __init__(self, fs: Any, path: str, settle: float) -> None:
        super().__init__(fs, path, settle)
        self.lock_path = f"{path}.lock"
        # thread_local=False: the renewer thread may release (on_lost) what acquire took
        self._flock = filelock.FileLock(self.lock_path, thread_local=False)
        self._held: tuple[int, int] | None = None  # (device, inode) of the locked file

    def read(self) -> _Seen | None:
        try:
            with open(self.path, "rb") as fh:
                return _seen(fh.read(), time.time() - os.fstat(fh.fileno()).st_mtime)
        except FileNotFoundError:
            return None

    def _file(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.lock_path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def hold(self) -> bool:
        os.makedirs(os.path.dirname(self.lock_path), exist_ok=True)
        try:
            self._flock.acquire(timeout=0)
        except filelock.Timeout:
            return False
        self._held = self._file()  # the locked file: only a holder removes it, so still there
        return True

    def lock_lost(self) -> str | None:
        if self._held is not None and self._file() == self._held:
            return None
        return f"its lock file {self.lock_path} was deleted or replaced"

    def unhold(self) -> None:
        if not self._flock.is_locked:
            return
        try:  # removed while held: a waiter's flock on it is discarded; a leftover is harmless
            if self.lock_lost() is None:
                with contextlib.suppress(OSError):
                    os.remove(self.lock_path)
        finally:
            self._held = None
            self._flock.release(force=True)


class _S3Store(_ObjectStore):
    """s3:// via s3fs: PutObject/DeleteObject conditional on `If-None-Match: *` or `If-Match`."""

    conditional = True  # False once the store was seen to ignore If-None-Match

    def _call(self, method: str, **kwargs: Any) -> Any:
        bucket, key, _ = self.fs.split_path(self.path)

        async def call() -> Any:
            out = await self.fs._call_s3(method, Bucket=bucket, Key=key, **kwargs)
            return (out, await out["Body"].read()) if method == "get_object" else out

        return sync(self.fs.loop, call)

    def read(self) -> _Seen | None:
        try:
            out, data = self._call("get_object")
        except FileNotFoundError:
            return None
        date = out.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
        return _seen(data, now - out["LastModified"].timestamp() - 1.0, out["ETag"])

    def _if(self, method: str, **kwargs: Any) -> bool | None:
        """One conditional call: True done, False condition not met, None conditions ignored."""
        if not self.conditional:
            return None
        try:
            self._call(method, **kwargs)
        except Exception as exc:
            if storage.error_code(exc) in _FAILED:
                return False
            raise
        return True

    def create(self, data: bytes) -> bool:
        done = self._if("put_object", Body=data, IfNoneMatch="*")
        if done and self._if("put_object", Body=data, IfNoneMatch="*"):  # probe: must fail
            msg = "s3://%s ignores If-None-Match: check, write, read back after %.1f s instead"
            log.warning(msg, self.path, self.settle)
            self.conditional = False
        return super().create(data) if done is None else done

    def takeover(self, data: bytes, tag: str) -> bool:
        done = self._if("put_object", Body=data, IfMatch=tag)
        return super().takeover(data, tag) if done is None else done

    renew = takeover

    def delete(self, tag: str) -> None:
        if self._if("delete_object", IfMatch=tag) is None:
            super().delete(tag)


class RunLease:
    """The lease on one run folder: acquire, renew in the background, report loss, release."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        ttl: float = 60.0,
        on_lost: Callable[[str], None] | None = None,
        settle: float | None = None,
    ) -> None:
        if not ttl > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl!r}")
        fs, root = storage.open_fs(url, storage_options)
        path = storage.join(root, LEASE_NAME)
        if storage.is_local(fs):
            self._store: _ObjectStore = _LocalStore(fs, path, settle or 0.0)
        else:
            store = _S3Store if hasattr(fs, "_call_s3") else _ObjectStore
            self._store = store(fs, path, 0.5 if settle is None else settle)
        self.url, self.ttl, self.on_lost, self._options = url, float(ttl), on_lost, storage_options
        self.lease_url = storage.display_url(fs, path)
        self.info: LeaseInfo | None = None  # our lease, once acquired
        self.lost: str | None = None  # why it was lost, once it was
        self._lock, self._stop = threading.RLock(), threading.Event()
        self._thread: threading.Thread | None = None
        self._last_ok = 0.0

    def _judge(self, seen: _Seen) -> str:
        """Why `seen` may be taken over; raises RunLeaseHeldError when its holder is live."""
        info, ttl = seen.info, seen.info.ttl if seen.info else self.ttl
        if seen.age >= ttl:
            who = f"its holder ({info.who()})" if info else "it (unreadable)"
            return f"{who} last renewed it {seen.age:.0f} s ago, more than its ttl of {ttl:g} s"
        if info is not None and _holder_dead(info):
            return f"its holder ({info.who()}) is no longer running on this host"
        holder = info.who() if info else f"an unreadable lease {self.lease_url}"
        raise RunLeaseHeldError(
            f"run {self.url} is held by another training run ({holder}; lease renewed "
            f"{seen.age:.0f} s ago): wait for it to finish; if that process is dead the lease "
            f"expires in {math.ceil(ttl - seen.age)} s; or give another --run-id."
        )

    def _hold(self) -> None:
        """Take the store's lock; while a live process holds it, raise naming that process."""
        deadline = time.monotonic() + 1.0  # a racer between its flock and its lease write
        while not self._store.hold():
            seen = self._store.read()
            if seen is not None:
                self._judge(seen)  # raises when that lease is fresh and its holder alive
            if time.monotonic() > deadline:
                who = f"{seen.info.who()}, " if seen and seen.info else ""
                age = f"lease renewed {seen.age:.0f} s ago" if seen else "no lease written"
                raise RunLeaseHeldError(
                    f"run {self.url} is held by another training run ({who}{age}) that holds "
                    f"{self._store.lock_path} but does not renew its lease: it may be stopped "
                    "or hung; end it, or give another --run-id."
                )
            time.sleep(0.05)

    def acquire(self) -> RunLease:
        """Take the lease (or raise RunLeaseHeldError naming its holder), then start renewing."""
        now, pid, host = time.time(), os.getpid(), socket.gethostname()
        started = liveness.process_started(pid)
        me = LeaseInfo(uuid.uuid4().hex, host, _MACHINE, pid, started, now, now, self.ttl)
        with storage.storage_errors(self.lease_url, "take the run lease", self._options):
            self._hold()
            try:
                self._take(me)
            except BaseException:
                self._store.unhold()
                raise
        self.info, self._last_ok = me, time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="run-lease", daemon=True)
        self._thread.start()
        return self

    def _take(self, me: LeaseInfo) -> None:
        """Write lease `me`, taking over a stale one (5 tries: racers on stores without locks)."""
        for _ in range(5):
            seen = self._store.read()
            if _ours(seen, me.holder):  # ours after all: an earlier read-back came too soon
                return
            if seen is None:
                done = self._store.create(me.to_bytes())
            else:
                log.warning("taking over %s: %s", self.lease_url, self._judge(seen))
                done = self._store.takeover(me.to_bytes(), seen.tag)
            if done:
                time.sleep(self._store.settle)
                if _ours(self._store.read(), me.holder):
                    return
        msg = f"run {self.url}: other runs kept taking its lease (5 tries)"
        raise RunLeaseHeldError(f"{msg}: stop them or give another --run-id.")

    def renew(self) -> bool:
        """Renew now; False (after reporting the loss) when the lease is no longer ours."""
        with self._lock:
            if self.info is None or self.lost is not None:
                return False
            why = self._store.lock_lost()
            if why is None:
                seen = self._store.read()
                if _ours(seen, self.info.holder):
                    info = replace(self.info, renewed=time.time())
                    if self._store.renew(info.to_bytes(), seen.tag):
                        self.info, self._last_ok = info, time.monotonic()
                        return True
                    seen = self._store.read()  # it changed meanwhile
                other = seen.info.who() if seen and seen.info else "nobody (it was deleted)"
                why = f"the lease now belongs to {other}"
        self._lose(why)  # outside the lock: on_lost may release
        return False

    def _loop(self) -> None:
        """Renew every ttl/3 s until stopped or lost; storage errors are retried until the ttl."""
        while not self._stop.wait(self.ttl / 3):
            try:
                if not self.renew():
                    return
            except Exception as exc:
                late = time.monotonic() - self._last_ok
                log.warning("could not renew the run lease %s: %s", self.lease_url, exc)
                if late >= self.ttl:
                    self._lose(f"could not renew it for {late:.0f} s (ttl {self.ttl:g} s): {exc}")
                    return

    def _lose(self, reason: str) -> None:
        """Record the loss once, log it and call `on_lost`."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = reason
        log.error("lost the run lease %s: %s", self.lease_url, reason)
        if self.on_lost is not None:
            self.on_lost(reason)

    def release(self) -> None:
        """Stop renewing; delete the lease only if it is still ours (failures are only logged)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            holder, self.info = self.info.holder if self.info else None, None
            try:
                seen = self._store.read() if holder else None
                if _ours(seen, holder):  # someone else's lease stays
                    self._store.delete(seen.tag)
            except Exception as exc:
                log.warning("could not release %s (%s); it expires in its ttl", self.lease_url, exc)
            finally:
                self._store.unhold()

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


hold_run = RunLease  # `with hold_run(url, options, ttl=60, on_lost=f) as lease:` holds the run


def read_lease(url: str, storage_options: Mapping[str, Any] | None = None) -> LeaseInfo | None:
    """The lease on run folder `url` now (None when free or unreadable), for status tools."""
    seen = RunLease(url, storage_options)._store.read()
    return seen.info if seen is not None else None
