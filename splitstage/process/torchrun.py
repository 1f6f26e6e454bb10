"""Run `torchrun` (c10d rendezvous, one or many nodes) as a subprocess we can watch and stop.

A job of one process (one node, one process, no restarts) runs without torchrun's agent, as
accelerate's launcher runs one process: the rank is started directly on a one-rank group (no
rendezvous to host, nothing to restart), which saves the agent's Python and its torch import
(~220 MB resident) for the whole run; its lines, logs and failure report look as torchrun's do.
Output streams line by line (`--tee 3`: each worker line is prefixed `[default<local_rank>]:`).
On failure the result names the first failing rank and its error (torchrun's `error.json` when the
worker used `@record`, else the tail of that rank's stderr log). torchrun's own report of a failed
worker (its ChildFailedError traceback and table) goes to the log dir's torchrun.log, not to the
terminal: the failing rank's lines already say why. Cancelling (a threading.Event,
a timeout, KeyboardInterrupt or an exception from `on_line`) ends the whole process tree:
torchrun's workers run in their own sessions, so its process group alone would leave them alive.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import psutil

from splitstage.process.liveness import kill_tree, process_started, snapshot_tree

DEFAULT_RDZV_ID = "splitstage"
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_ENDPOINT = re.compile(r"^\[?[\w.:-]+\]?:\d+$")
_RANK_LINE = re.compile(r"^\[\w*?\d+\]:")  # --tee prefix of a worker's line: [default0]:
ONE_RANK_PREFIX = "[default0]:"  # the same prefix on the lines of a job run without the agent
ONE_RANK_LOGS = ("local", "attempt_0", "0")  # torchrun's per-rank log layout, under the log dir
ONE_RANK_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "GROUP_RANK": "0",
    "ROLE_RANK": "0",
    "ROLE_WORLD_SIZE": "1",
}
_ELASTIC_LOG = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S*torch/distributed/elastic/")
AGENT_MODULE = "splitstage.process.torchrun_agent"  # torchrun that always exits
AGENT_LOG = "torchrun.log"  # in the log dir: every line of the run, torchrun's own report too


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (bind to port 0); another process may still take it later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class TorchrunSpec:
    """One torchrun agent: this node's part of a job of `nnodes` x `nproc_per_node` workers."""

    module_or_script: str
    args: Sequence[str] = ()
    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # "host:port"; None on one node: a standalone rendezvous
    rdzv_id: str = DEFAULT_RDZV_ID  # the same on every node of one job
    max_restarts: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    python: str = sys.executable

    def validate(self) -> None:
        """Raise ValueError naming the field when the spec cannot form a job."""
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError(
                f"nnodes={self.nnodes} and nproc_per_node={self.nproc_per_node} must be >= 1"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"nnodes={self.nnodes} needs rdzv_endpoint='host:port' of a host every node "
                "reaches (the same on all nodes)"
            )
        if self.rdzv_endpoint and not _ENDPOINT.match(self.rdzv_endpoint):
            raise ValueError(f"rdzv_endpoint={self.rdzv_endpoint!r} is not 'host:port'")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be >= 0")
        if not self.module_or_script:
            raise ValueError("module_or_script is empty: name a module or a .py script")

    @property
    def uses_agent(self) -> bool:
        """torchrun's agent earns its keep with a rendezvous to host or restarts to run; one
        process on one node with neither is started directly (see the module docstring)."""
        return (
            self.nnodes > 1
            or self.nproc_per_node > 1
            or self.max_restarts > 0
            or self.rdzv_endpoint is not None
        )

    @property
    def is_script(self) -> bool:
        """A path to a .py file (run as a script) rather than a module name (run with -m)."""
        target = self.module_or_script
        return target.endswith(".py") or os.sep in target or os.path.isfile(target)


def build_command(spec: TorchrunSpec, *, log_dir: str | None = None) -> list[str]:
    """The torchrun command line for `spec` (`spec.python -m` our agent: torchrun that exits)."""
    spec.validate()
    if not spec.uses_agent:
        return one_rank_command(spec)
    cmd = [spec.python, "-m", AGENT_MODULE]
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        cmd.append("--standalone")  # c10d on localhost, port picked by the OS: no port race
    else:
        cmd += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={spec.rdzv_id}",
        ]
    cmd += [
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--max-restarts={spec.max_restarts}",
    ]
    if log_dir:
        cmd += [f"--log-dir={log_dir}", "--tee=3"]
    if spec.is_script:
        cmd.append(spec.module_or_script)
    else:
        cmd += ["-m", spec.module_or_script]
    return cmd + [str(a) for a in spec.args]


def one_rank_command(spec: TorchrunSpec) -> list[str]:
    """The rank's own command line, for a job run without torchrun's agent."""
    target = [spec.module_or_script] if spec.is_script else ["-m", spec.module_or_script]
    return [spec.python, *target, *[str(a) for a in spec.args]]


@dataclass
class TorchrunResult:
    """How a torchrun agent ended, and which rank failed first with what error."""

    command: list[str]
    returncode: int | None
    output_tail: list[str]
    log_dir: str | None
    failed_rank: int | None = None
    failed_local_rank: int | None = None
    error: str | None = None
    timed_out: bool = False
    cancelled: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when torchrun and all its workers exited 0."""
        return self.returncode == 0 and not (self.timed_out or self.cancelled)

    def raise_for_status(self) -> None:
        """Raise TorchrunError unless the run succeeded."""
        if not self.ok:
            raise TorchrunError(self)


class TorchrunError(RuntimeError):
    """A torchrun job failed, timed out or was cancelled; `.result` has the details."""

    def __init__(self, result: TorchrunResult) -> None:
        self.result = result
        if result.timed_out:
            what = "timed out"
        elif result.cancelled:
            what = "was cancelled"
        else:
            what = f"failed (exit {result.returncode})"
        where = ""
        if result.failed_rank is not None:
            where = f": rank {result.failed_rank} (local rank {result.failed_local_rank})"
        detail = f"\n{result.error}" if result.error else ""
        logs = f"\nper-rank logs: {result.log_dir}" if result.log_dir else ""
        who = "torchrun" if AGENT_MODULE in result.command else "the training process"
        super().__init__(f"{who} {what}{where}{detail}{logs}")


_DIE_WITH_PARENT = (  # prctl(PR_SET_PDEATHSIG, SIGTERM) survives the exec
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dies_with_this_process(command: Sequence[str]) -> list[str]:
    """`command`, SIGTERMed if the launching thread dies (Linux): a SIGKILLed launcher ends
    torchrun and its workers, which would otherwise train on after the run's lease expired."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def _rank_dir(log_dir: str, local_rank: int) -> str | None:
    """The newest attempt's log directory of a local rank."""
    dirs = glob.glob(os.path.join(log_dir, "*", "attempt_*", str(local_rank)))
    if not dirs:
        return None
    return max(dirs, key=lambda d: int(os.path.basename(os.path.dirname(d)).split("_")[-1]))


def _rank_error(log_dir: str | None, local_rank: int, exitcode: int | None) -> str | None:
    """The failing rank's error: error.json's message, else the tail of its stderr log."""
    prefix = f"exit code {exitcode}" if exitcode is not None else ""
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            prefix = f"killed by {signal.Signals(-exitcode).name}"
    rank_dir = _rank_dir(log_dir, local_rank) if log_dir else None
    if rank_dir is None:
        return prefix or None
    error_file = os.path.join(rank_dir, "error.json")
    if os.path.isfile(error_file):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            with open(error_file) as fh:
                message = json.load(fh)["message"]
            if isinstance(message, dict):
                extra = message.get("extraInfo", {})
                return f"{prefix}\n{extra.get('py_callstack') or message.get('message')}".strip()
            return f"{prefix}\n{message}".strip()
    stderr = os.path.join(rank_dir, "stderr.log")
    if os.path.isfile(stderr):
        with open(stderr, errors="replace") as fh:
            tail = "".join(deque(fh, maxlen=30)).rstrip()
        return f"{prefix}\n{tail}".strip()
    return prefix or None


def _root_cause(lines: Sequence[str]) -> tuple[int | None, int | None, int | None]:
    """(rank, local_rank, exitcode) from torchrun's 'Root Cause' summary, if printed."""
    rank = local_rank = exitcode = None
    seen_root = False
    for line in lines:
        if "Root Cause" in line:
            seen_root = True
        elif seen_root and rank is None and (m := _ROOT_RANK.match(line)):
            rank, local_rank = int(m.group(1)), int(m.group(2))
        elif seen_root and rank is not None and (m := _ROOT_EXIT.match(line)):
            exitcode = int(m.group(1))
            break
    return rank, local_rank, exitcode


class AgentReport:
    """Pass the workers' lines on; keep torchrun's own failure report (its elastic log lines and
    the ChildFailedError traceback with its 30-line table) in AGENT_LOG only, since the failing
    rank already said why. Any other agent traceback (a rendezvous that timed out) is the cause:
    it is passed on when the stream ends."""

    def __init__(self, log_path: str, on_line: Callable[[str], None] | None) -> None:
        self.log = open(log_path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
        self.log_path = log_path
        self.on_line = on_line
        self.traceback: list[str] | None = None
        self.withheld = 0

    def __call__(self, line: str) -> None:
        """Log one line; pass it on unless it belongs to torchrun's report of a failed child."""
        self.log.write(line + "\n")
        self.log.flush()
        if self.traceback is not None or line.startswith("Traceback (most recent call last)"):
            self.traceback = (self.traceback or []) + [line]  # the workers have ended by now
        elif _RANK_LINE.match(line):
            self._say(line)
        elif _ELASTIC_LOG.match(line):
            self.withheld += 1
        else:
            self._say(line)

    def close(self) -> None:
        """Pass on an agent traceback that is not torchrun's report of a failed child; say where
        the withheld lines are."""
        self.log.close()
        lines = self.traceback or []
        if lines and not any("ChildFailedError" in line for line in lines):
            for line in lines:
                self._say(line)
            lines = []
        if lines or self.withheld:
            self._say(f"torchrun's own report of the failure: {self.log_path}")

    def _say(self, line: str) -> None:
        if self.on_line is not None:
            self.on_line(line)


@dataclass
class Started:
    """A started process whose output is being pumped into `lines`: torchrun's agent, or the
    rank of a one-process job (then `rank_dir` holds its logs)."""

    command: list[str]
    proc: subprocess.Popen
    lines: queue.Queue
    readers: list[threading.Thread]
    log_dir: str
    own_logs: bool
    rank_dir: str | None
    known: dict[int, float]


def start(spec: TorchrunSpec, *, log_dir: str | None = None) -> Started:
    """Start `spec` with its output pumped: torchrun's agent, or a one-process job's rank
    directly."""
    own_logs = log_dir is None
    log_dir = tempfile.mkdtemp(prefix="splitstage-torchrun-") if own_logs else log_dir
    os.makedirs(log_dir, exist_ok=True)
    env = {**os.environ, **{k: str(v) for k, v in spec.env.items()}, "PYTHONUNBUFFERED": "1"}
    rank_dir = None if spec.uses_agent else os.path.join(log_dir, *ONE_RANK_LOGS)
    if rank_dir is not None:
        env = one_rank_env(env, rank_dir)
    command = build_command(spec, log_dir=log_dir)
    proc = subprocess.Popen(
        dies_with_this_process(command),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if rank_dir is None else subprocess.PIPE,
        env=env,
        start_new_session=True,
        text=True,
        errors="replace",
        bufsize=1,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    if rank_dir is None:  # torchrun's --tee prefixes the lines and writes the rank logs
        pumps = [(proc.stdout, "", None)]
    else:
        pumps = [
            (proc.stdout, ONE_RANK_PREFIX, os.path.join(rank_dir, "stdout.log")),
            (proc.stderr, ONE_RANK_PREFIX, os.path.join(rank_dir, "stderr.log")),
        ]
    readers = [threading.Thread(target=_pump, args=(*p, lines), daemon=True) for p in pumps]
    for reader in readers:
        reader.start()
    known = {proc.pid: process_started(proc.pid)}
    return Started(command, proc, lines, readers, log_dir, own_logs, rank_dir, known)


def run_torchrun(
    spec: TorchrunSpec,
    *,
    timeout: float | None = None,
    on_line: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    log_dir: str | None = None,
    check: bool = False,
    grace: float = 5.0,
    tail_lines: int = 200,
) -> TorchrunResult:
    """Run one torchrun agent to the end, streaming its combined output to `on_line`.

    `on_line` runs in the calling thread; an exception from it cancels the run and propagates.
    `timeout`/`cancel` end the process tree and mark the result. `check=True` raises
    TorchrunError when the run did not succeed. Per-rank logs go to `log_dir` (a temporary
    directory, deleted after a success, when not given).
    """
    clock = time.monotonic()
    started = start(spec, log_dir=log_dir)
    proc, lines, readers, known = started.proc, started.lines, started.readers, started.known
    log_dir, own_logs, rank_dir, command = (
        started.log_dir,
        started.own_logs,
        started.rank_dir,
        started.command,
    )
    tail: deque[str] = deque(maxlen=tail_lines)
    timed_out = cancelled = False
    report = AgentReport(os.path.join(log_dir, AGENT_LOG), on_line)
    try:
        streams = len(readers)
        timed_out, cancelled = _watch(proc, lines, streams, tail, known, report, cancel, timeout)
        if timed_out or cancelled:
            kill_tree(proc.pid, known, grace)
    except BaseException:
        kill_tree(proc.pid, known, grace)
        proc.wait()
        report.log.close()
        raise
    report.close()
    returncode = proc.wait()
    kill_tree(None, known, grace=1.0)  # workers torchrun failed to stop
    for reader in readers:
        reader.join(timeout=2)
    result = TorchrunResult(
        command=command,
        returncode=returncode,
        output_tail=list(tail),
        log_dir=log_dir,
        timed_out=timed_out,
        cancelled=cancelled,
        seconds=time.monotonic() - clock,
    )
    if not result.ok and not (timed_out or cancelled):
        if rank_dir is None:
            rank, local_rank, exitcode = _root_cause(result.output_tail)
        else:  # no agent: the one rank's own exit status
            rank, local_rank, exitcode = 0, 0, returncode
        result.failed_rank, result.failed_local_rank = rank, local_rank
        if local_rank is not None:
            result.error = _rank_error(log_dir, local_rank, exitcode)
        else:
            result.error = "\n".join(list(tail)[-30:])
    if result.ok and own_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
        result.log_dir = None
    if check:
        result.raise_for_status()
    return result


def one_rank_env(env: Mapping[str, str], rank_dir: str) -> dict[str, str]:
    """The environment of a rank run without the agent: rank 0 of 1, an env:// address for a
    script that opens its own group (`init_distributed` needs none for one rank), and
    `@record`'s error file where torchrun would put it."""
    os.makedirs(rank_dir, exist_ok=True)
    own = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")}
    return {
        **own,
        **ONE_RANK_ENV,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "TORCHELASTIC_ERROR_FILE": os.path.join(rank_dir, "error.json"),
    }


def _pump(stream, prefix: str, copy_to: str | None, lines: queue.Queue) -> None:
    """Reader thread: move output lines (prefixed) into the queue, and into `copy_to` when
    given; None marks the end of the stream."""
    copy = open(copy_to, "a", encoding="utf-8") if copy_to else None  # noqa: SIM115
    try:
        for line in stream:
            if copy is not None:
                copy.write(line)
                copy.flush()
            lines.put(prefix + line.rstrip("\n"))
    finally:
        if copy is not None:
            copy.close()
        lines.put(None)


def _watch(proc, lines, streams, tail, known, on_line, cancel, timeout) -> tuple[bool, bool]:
    """Deliver lines until torchrun ends (all `streams` closed); return (timed_out, cancelled)
    when stopped early."""
    deadline = None if timeout is None else time.monotonic() + timeout
    next_snapshot = 0.0
    eof, exited_at = False, None
    while True:
        if eof:
            time.sleep(0.1)
        else:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                pass
            else:
                if line is None:
                    streams -= 1
                    eof = streams == 0
                else:
                    tail.append(line)
                    if on_line is not None:
                        on_line(line)
        now = time.monotonic()
        if cancel is not None and cancel.is_set():
            return False, True
        if deadline is not None and now > deadline:
            return True, False
        if proc.poll() is None:
            if now >= next_snapshot:
                with contextlib.suppress(psutil.Error):
                    snapshot_tree(psutil.Process(proc.pid), known)
                next_snapshot = now + 0.5
            continue
        if eof:
            return False, False
        # torchrun is gone but a leaked worker may hold the pipe open: stop soon anyway.
        exited_at = exited_at or now
        if now - exited_at > 2.0 and lines.empty():
            return False, False
