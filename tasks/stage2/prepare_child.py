"""Run stage 2's set-up (`tasks/stage2/prepare.py`: plan, preflight) in a short-lived child
process and take its reply, so the launcher that holds the run never imports torch or a family.

The child's bad-input error is raised here again as the same one line (its own class when this
process has imported it, else the nearest one it has, at least `UserError`); an OSError keeps its
errno; a bug is a `PrepareError` carrying the child's traceback. Cancelling (the Event, Ctrl-C,
this process dying) ends the child; it runs in its own session, so a terminal's Ctrl-C reaches
only the launcher, which stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from splitstage.splitter import UserError
from splitstage.tasks.stage2.torchrun import (
    Started,
    TorchrunError,
    TorchrunResult,
    TorchrunSpec,
    dies_with_this_process,
    start,
)

PREPARE_MODULE = "splitstage.tasks.stage2.prepare"
WORKER_MODULE = "splitstage.tasks.stage2.worker"
SET_UP_FIRST = "--set-up-first"  # a one-process job's rank runs the set-up first (worker.py)


class PrepareError(RuntimeError):
    """The set-up process failed on something other than bad input (a bug, or it was killed)."""


@dataclass
class StagedFile:
    """A file the child wrote into the staging folder; `save` moves it where the spec names it
    (what `write_spec` asks of the samples)."""

    path: str

    def save(self, destination: str) -> None:
        """Move the staged file to `destination` (after the launcher holds the run)."""
        shutil.move(self.path, destination)


@dataclass
class Prepared:
    """The child's reply: the run's places, what to say before launch, and what the spec holds."""

    paths: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cache_key: str | None = None
    split: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    samples_file: str | None = None
    rank: Started | None = field(default=None, repr=False)  # the child, become the rank-to-be

    @property
    def samples(self) -> StagedFile | None:
        """The staged training keys, when not the cache's manifest."""
        return None if self.samples_file is None else StagedFile(self.samples_file)


def child_env() -> dict[str, str]:
    """This process's environment, plus the Prefect API it talks to when that is set in-process
    (a flow, a test harness): the child reads credentials blocks where the launcher would."""
    env = dict(os.environ)
    settings = sys.modules.get("prefect.settings")  # never imported here for this
    if settings is not None and "PREFECT_API_URL" not in env:
        with contextlib.suppress(Exception):
            if url := settings.PREFECT_API_URL.value():
                env["PREFECT_API_URL"] = str(url)
    return env


def prepare_in_child(
    config: Any,
    run_id: str,
    run_root: str | Path,
    staging: Path,
    cancel: threading.Event | None = None,
    *,
    rank: TorchrunSpec | None = None,
    on_line: Callable[[str], None] | None = None,
) -> Prepared:
    """Plan and check the run in a child process (`prepare.main`); its files go to `staging`.
    With `rank` (a one-process job) the child is the job's rank, which runs the set-up first
    (`Prepared.rank`: its output already pumped to `on_line`, see `worker --set-up-first`)."""
    request, reply = staging / "request.json", staging / "reply.json"
    document = {"config": config.model_dump(mode="json"), "run_id": run_id}
    request.write_text(json.dumps({**document, "run_root": str(run_root)}))
    if rank is not None:  # the rank itself runs the set-up first
        command = [sys.executable, "-m", WORKER_MODULE, SET_UP_FIRST, str(request), str(reply)]
        return prepare_then_train(rank, command, reply, cancel, on_line)
    command = [sys.executable, "-m", PREPARE_MODULE, str(request), str(reply)]
    proc = subprocess.Popen(
        dies_with_this_process(command),
        stdin=subprocess.DEVNULL,
        env=child_env(),
        start_new_session=True,
    )
    try:
        code = wait(proc, cancel, command)
    finally:
        stop(proc)
    return read_reply(reply, code)


def prepare_then_train(
    rank: TorchrunSpec,
    command: list[str],
    reply: Path,
    cancel: threading.Event | None,
    on_line: Callable[[str], None] | None,
) -> Prepared:
    """Start the child that becomes the one rank; wait for its reply, passing its lines on."""
    child = start(rank, command=command, env=child_env())
    try:
        while not reply.is_file() and child.proc.poll() is None:
            with contextlib.suppress(queue.Empty):
                line = child.lines.get(timeout=0.1)
                if line is not None and on_line is not None:
                    on_line(line)
            if cancel is not None and cancel.is_set():
                raise TorchrunError(TorchrunResult(command, None, [], None, cancelled=True))
        answer = json.loads(reply.read_text()) if reply.is_file() else {}
        if "prepared" not in answer:  # it failed: it exits with its code, its last lines said
            code = child.proc.wait()
            for reader in child.readers:
                reader.join(timeout=2)
            while on_line is not None and not child.lines.empty():
                if (line := child.lines.get()) is not None:
                    on_line(line)
            return read_reply(reply, code)
    except BaseException:
        child.stop()
        raise
    prepared = Prepared(**answer["prepared"])
    prepared.rank = child
    return prepared


def read_reply(reply: Path, code: int) -> Prepared:
    """The child's reply as `Prepared`, or its error raised again here."""
    answer = json.loads(reply.read_text()) if reply.is_file() else {}
    if "prepared" in answer and code == 0:
        return Prepared(**answer["prepared"])
    raise_reply(answer.get("error"), code)


def wait(proc: subprocess.Popen, cancel: threading.Event | None, command: list[str]) -> int:
    """The child's exit code; a set `cancel` ends the wait as it ends a run (TorchrunError)."""
    while True:
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        if cancel is not None and cancel.is_set():
            result = TorchrunResult(command, None, [], None, cancelled=True)
            raise TorchrunError(result)


def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End the child and anything it started (its own process group), if still running."""
    if proc.poll() is not None:
        return
    for sig, seconds in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=seconds)
            return
        except subprocess.TimeoutExpired:
            continue


def raise_reply(error: dict[str, Any] | None, code: int) -> NoReturn:
    """Raise the child's error again in this process."""
    if error is None:
        how = f"exit {code}"
        if code < 0:
            with contextlib.suppress(ValueError):
                how = f"killed by {signal.Signals(-code).name}"
        raise PrepareError(f"preparing the run failed ({how}) before it could say why")
    if error["kind"] == "user":
        raise user_error(error["message"], error["classes"]) from None
    trace = error.get("traceback", "")
    if error["kind"] == "os":
        cause = PrepareError(f"in the set-up process:\n{trace}")
        raise OSError(error["errno"], error["strerror"], error.get("filename")) from cause
    raise PrepareError(f"preparing the run failed in its own process:\n{trace}")


def user_error(message: str, classes: list[list[str]]) -> UserError:
    """`message` as the child's error class, or the nearest base of it this process has
    imported (never importing one: that could be torch), down to `UserError`."""
    for module_name, qualname in classes:
        found: Any = sys.modules.get(module_name)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if not (isinstance(found, type) and issubclass(found, UserError)):
            continue
        try:
            error = found(message)
        except Exception:  # a class that takes other arguments: try its base
            continue
        if str(error) == message:
            return error
    return UserError(message)
