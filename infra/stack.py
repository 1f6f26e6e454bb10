"""The local stack: a Prefect server, work pools, workers and (optionally) an S3 endpoint.

    infra/stack.sh up [--s3] [--port N]   # start it, register deployments/prefect.yaml
    infra/stack.sh status                 # what runs, and the environment to use it
    infra/stack.sh down                   # stop everything it started; nothing is left running

Prefect's state lives in `.prefect/stack/` (PREFECT_HOME), so stack runs never mix with the user's
own Prefect profile or dashboard. The server listens on 127.0.0.1 on a free port (not 4200), given
as PREFECT_SERVER_API_HOST/PORT so the UI points at the right API. Every process the stack starts
carries SPLITSTAGE_STACK_ID in its environment; `down` stops the workers (two SIGTERMs: a worker
ignores the first for a long time), the server and the S3 endpoint, then anything else with that
id (flow runs and torchrun workers the workers started).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from splitstage.process.torchrun import free_port

ROOT = Path(__file__).resolve().parents[1]
STACK_ID_ENV = "SPLITSTAGE_STACK_ID"
K8S = Path(__file__).resolve().parent / "k8s"
# name -> (type, base job template or None, concurrency limit or None). The GPU pool is a process
# pool here (concurrency = "GPUs"); the multinode pool is the real Kubernetes template, so
# deploying validates the deployment's job variables against it (no local worker serves it).
POOLS = {
    "splitstage-local": ("process", None, None),
    "splitstage-gpu": ("process", None, 2),
    "splitstage-multinode": ("kubernetes", K8S / "multinode-job-template.json", None),
}
WORKER_POOLS = ("splitstage-local", "splitstage-gpu")
S3_BUCKET = "splitstage"
# moto accepts any credentials; these are placeholders for the local endpoint only.
MOTO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "moto", "AWS_SECRET_ACCESS_KEY": "moto"}


class StackError(RuntimeError):
    """The stack could not start or stop; the message names the step and its log file."""


@dataclass
class StackState:
    """What `up` started: saved as state.json so `down` and `status` find it."""

    stack_id: str
    port: int
    api_url: str
    ui_url: str
    s3_endpoint: str | None = None
    pids: dict[str, int] = field(default_factory=dict)


class Stack:
    """Start and stop the local stack; the state folder holds logs, pids and state.json."""

    def __init__(
        self,
        home: Path | None = None,
        *,
        root: Path = ROOT,
        python: str = sys.executable,
        worker_query_seconds: float = 2.0,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.home = Path(home or root / ".prefect" / "stack").resolve()
        self.logs = self.home / "logs"
        self.state_file = self.home / "state.json"
        self.python = python
        self.worker_query_seconds = worker_query_seconds
        self.extra_env = dict(extra_env or {})
        self.state: StackState | None = self.load()

    # ---- state and environment -----------------------------------------------------------
    def load(self) -> StackState | None:
        """The saved state of a running stack, if any."""
        if not self.state_file.is_file():
            return None
        return StackState(**json.loads(self.state_file.read_text()))

    def save(self) -> None:
        """Write state.json (ports, URLs, pids)."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(asdict(self.state), indent=2))

    def env(self) -> dict[str, str]:
        """Environment for Prefect commands and stack processes (no credentials but moto's)."""
        state = self.state
        env = {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": state.api_url,
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(state.port),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": str(self.worker_query_seconds),
            "PREFECT_CLI_PROMPT": "false",
            "SPLITSTAGE_CODE_DIR": str(self.root),
            STACK_ID_ENV: state.stack_id,
            **self.extra_env,
        }
        if state.s3_endpoint:
            env.update(MOTO_CREDENTIALS)
            env["AWS_ENDPOINT_URL_S3"] = state.s3_endpoint
            env["AWS_EC2_METADATA_DISABLED"] = "true"
        return env

    def exports(self) -> str:
        """Shell lines that point a terminal at this stack."""
        env = self.env()
        names = ["PREFECT_HOME", "PREFECT_API_URL", "SPLITSTAGE_CODE_DIR"]
        if self.state.s3_endpoint:
            names += ["AWS_ENDPOINT_URL_S3", *MOTO_CREDENTIALS]
        return "\n".join(f"export {name}={env[name]}" for name in names)

    # ---- processes --------------------------------------------------------------------------
    def spawn(self, name: str, command: list[str]) -> int:
        """Start a long-running process in its own session, logging to logs/<name>.log."""
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                command,
                cwd=self.root,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.state.pids[name] = proc.pid
        self.save()
        return proc.pid

    def prefect(self, *args: str, timeout: float = 300) -> str:
        """Run a Prefect CLI command against the stack; raise StackError with its output."""
        command = [self.python, "-m", "prefect", *args]
        done = subprocess.run(
            command,
            cwd=self.root,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise StackError(
                f"`prefect {' '.join(args)}` failed (exit {done.returncode}):\n"
                f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        return done.stdout

    def wait_healthy(self, timeout: float = 120) -> None:
        """Poll /api/health until the server answers (15-20 s on 2 cores)."""
        deadline = time.monotonic() + timeout
        url = f"{self.state.api_url}/health"
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
            if not psutil.pid_exists(self.state.pids["server"]):
                break
            time.sleep(0.5)
        raise StackError(
            f"the Prefect server did not become healthy at {url} within {timeout:.0f} s; "
            f"see {self.logs / 'server.log'}"
        )

    # ---- up -------------------------------------------------------------------------------------
    def up(
        self,
        *,
        port: int | None = None,
        s3: bool = False,
        deploy: bool = True,
        workers: tuple[str, ...] = WORKER_POOLS,
        inputs: bool = True,
    ) -> StackState:
        """Start server (+ S3), create pools, prepare demo inputs, deploy, start workers."""
        if self.state and psutil.pid_exists(self.state.pids.get("server", -1)):
            raise StackError(
                f"a stack already runs from {self.home} ({self.state.ui_url}); run "
                "`infra/stack.sh down` first"
            )
        self.home.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        self.state = StackState(
            stack_id=secrets.token_hex(8),
            port=port,
            api_url=f"http://127.0.0.1:{port}/api",
            ui_url=f"http://127.0.0.1:{port}",
        )
        self.save()
        try:
            self.spawn("server", [self.python, "-m", "prefect", "server", "start"])
            if s3:
                self.start_s3()
            self.wait_healthy()
            self.create_pools()
            if inputs:
                self.run_python("-m", "splitstage.demo", "--prepare-only")
            if deploy:
                self.prefect("--no-prompt", "deploy", "--all", "--prefect-file", self.prefect_file)
            for pool in workers:
                self.start_worker(pool)
        except BaseException:
            self.down()
            raise
        return self.state

    @property
    def prefect_file(self) -> str:
        """deployments/prefect.yaml."""
        return str(self.root / "deployments" / "prefect.yaml")

    def run_python(self, *args: str) -> None:
        """Run a Python module of the project with the stack's environment."""
        done = subprocess.run(
            [self.python, *args], cwd=self.root, env=self.env(), capture_output=True, text=True
        )
        if done.returncode != 0:
            raise StackError(f"`python {' '.join(args)}` failed:\n{done.stdout}{done.stderr}")

    def start_s3(self) -> None:
        """A moto S3 server on a free loopback port, with bucket `splitstage`."""
        port = free_port()
        self.state.s3_endpoint = f"http://127.0.0.1:{port}"
        self.save()
        self.spawn("s3", [self.python, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                request = urllib.request.Request(
                    f"{self.state.s3_endpoint}/{S3_BUCKET}", method="PUT"
                )
                with urllib.request.urlopen(request, timeout=2):
                    return
            time.sleep(0.3)
        raise StackError(f"the S3 endpoint did not start; see {self.logs / 's3.log'}")

    def create_pools(self) -> None:
        """The work pools the deployments name (process pools locally)."""
        for pool, (kind, template, limit) in POOLS.items():
            with contextlib.suppress(StackError):  # a pool of another type from an older stack
                if f"type='{kind}'" not in self.prefect("work-pool", "inspect", pool):
                    self.prefect("work-pool", "delete", pool)
            extra = ["--base-job-template", str(template)] if template else []
            self.prefect("work-pool", "create", pool, "--type", kind, "--overwrite", *extra)
            if limit:
                self.prefect("work-pool", "set-concurrency-limit", pool, str(limit))

    def start_worker(self, pool: str) -> None:
        """A process worker polling `pool`."""
        self.spawn(
            f"worker-{pool}",
            [self.python, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"],
        )

    # ---- down -----------------------------------------------------------------------------------
    def down(self, timeout: float = 30) -> list[str]:
        """Stop workers (SIGTERM twice), server, S3, then anything else tagged with the stack id."""
        if self.state is None:
            return []
        stopped = []
        names = sorted(self.state.pids, key=lambda n: (not n.startswith("worker"), n))
        for name in names:
            pid = self.state.pids[name]
            if stop_group(pid, twice=name.startswith("worker"), timeout=timeout):
                stopped.append(name)
        stopped += [f"pid {pid}" for pid in kill_tagged(self.state.stack_id)]
        self.state_file.unlink(missing_ok=True)
        self.state = None
        return stopped

    def status(self) -> dict[str, bool]:
        """Each started process and whether it still runs."""
        if self.state is None:
            return {}
        return {name: psutil.pid_exists(pid) for name, pid in self.state.pids.items()}


def _signal_group(pid: int, sig: int) -> None:
    """Send a signal to a process group (each stack process leads its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _group_alive(pid: int) -> bool:
    """True while any process of the group runs."""
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return any(
        p.info["status"] != psutil.STATUS_ZOMBIE
        for p in psutil.process_iter(["status"])
        if _pgid(p.pid) == pid
    )


def _pgid(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return os.getpgid(pid)
    return None


def stop_group(pid: int, *, twice: bool = False, timeout: float = 30) -> bool:
    """SIGTERM a process group (again after 2 s if `twice`), then SIGKILL what is left."""
    if not _group_alive(pid):
        return False
    _signal_group(pid, signal.SIGTERM)
    if twice:
        time.sleep(2)
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pid):
        _signal_group(pid, signal.SIGKILL)
    return True


def kill_tagged(stack_id: str, grace: float = 5.0) -> list[int]:
    """Stop processes whose environment carries this stack id (left over flow runs, torchrun)."""
    me = os.getpid()
    tagged = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid != me and proc.environ().get(STACK_ID_ENV) == stack_id:
                tagged.append(proc)
    for proc in tagged:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(tagged, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return [p.pid for p in tagged]


def main(argv: list[str] | None = None) -> int:
    """`up`, `down` or `status`."""
    parser = argparse.ArgumentParser(prog="infra/stack.sh", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the stack and register the deployments")
    up.add_argument("--s3", action="store_true", help="also start a moto S3 endpoint")
    up.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    up.add_argument("--no-deploy", action="store_true", help="do not register deployments")
    sub.add_parser("down", help="stop everything the stack started")
    sub.add_parser("status", help="show what runs")
    args = parser.parse_args(argv)
    stack = Stack()
    try:
        if args.command == "up":
            print(f"starting the Prefect server ({stack.home}) ...", flush=True)
            state = stack.up(port=args.port, s3=args.s3, deploy=not args.no_deploy)
            print(f"UI:  {state.ui_url}\nAPI: {state.api_url}")
            if state.s3_endpoint:
                print(f"S3:  {state.s3_endpoint} (bucket {S3_BUCKET})")
            print(f"logs: {stack.logs}\n\nPoint a shell at it:\n{stack.exports()}")
            print("\nthen: prefect deployment run 'split-training/local' --watch")
        elif args.command == "down":
            stopped = stack.down()
            print(f"stopped: {', '.join(stopped)}" if stopped else "no stack was running")
        else:
            running = stack.status()
            if not running:
                print("no stack is running")
                return 1
            print(f"UI: {stack.state.ui_url}")
            for name, alive in running.items():
                print(f"  {name}: {'running' if alive else 'stopped'}")
            print(stack.exports())
    except StackError as error:
        print(f"stack: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
