"""The launcher that stays alive beside torchrun is lean: a real `splitstage train` never imports
torch, a family's libraries or a model in its own process (the plan and the preflight run once, in
a short-lived child); the child's bad input reaches the user as the same one line; cancelling ends
the child; the child's set-up reads no weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from splitstage.config.job import ConfigError
from splitstage.splitter import UserError
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2.launch import train
from splitstage.tasks.stage2.preflight import StaleCacheError
from splitstage.tasks.stage2.prepare import prepare
from splitstage.tasks.stage2.prepare_child import PrepareError, raise_reply, user_error
from splitstage.tasks.stage2.torchrun import TorchrunError
from tests.helpers.signals import default_sigint
from tests.helpers.tiny_job import make_workspace, tiny_config
from tests.helpers.toml_job import toml
from tests.helpers.weight_loads import weight_loads

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "diffusers", "transformers", "safetensors.torch", "numpy")
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
# The real CLI in a fresh process; at its end, what it imported and its own peak memory (polled:
# ru_maxrss would report pytest's, which a forked child inherits into its exec).
LAUNCHER = (
    "import json, sys, threading, time, psutil\n"
    "peak = [0.0]\n"
    "def poll(me=psutil.Process()):\n"
    "    while True:\n"
    "        peak[0] = max(peak[0], me.memory_info().rss / 2**20)\n"
    "        time.sleep(0.02)\n"
    "threading.Thread(target=poll, daemon=True).start()\n"
    "from splitstage.cli import main\n"
    "code = main(sys.argv[1:])\n"
    f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
    "print('LAUNCHER ' + json.dumps({'code': code, 'imported': heavy, 'peak_mb': peak[0]}))\n"
    "sys.exit(code)\n"
)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("lean"), samples=4, seed=0)


def job_file(root: Path, name: str, **train_fields) -> Path:
    """The tiny demo job (tests/helpers/tiny_job.py) as the TOML file the CLI reads."""
    document = tiny_config(root, name, 0, batch_size=2, max_steps=1, **train_fields)
    body = document.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    path = root / f"{name}.toml"
    path.write_text(toml(body))
    return path


def launch(args: list[str]) -> tuple[dict, str]:
    """Run the CLI as a launcher process; (its closing figures, its whole output)."""
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("LAUNCHER "))
    return json.loads(line.removeprefix("LAUNCHER ")), done.stdout + done.stderr


def test_a_real_train_launcher_never_imports_torch(workspace):
    figures, output = launch(["train", str(job_file(workspace, "lean")), "--json"])
    assert figures["code"] == 0, output
    printed = output[: output.index("LAUNCHER ")]  # the --json report is printed last
    report = json.loads(printed[printed.rindex("\n{") :])
    assert report["updates"] == 1 and "dit" in report["outputs"]
    assert figures["imported"] == [], output  # not even numpy: the set-up child had them
    # the launcher's own peak, against the rank's (both RSS; shared pages count in each)
    assert figures["peak_mb"] < 0.25 * report["peak_rss_mb"], (figures, report["peak_rss_mb"])


def test_bad_input_found_in_the_child_is_one_line_exit_2(workspace, tmp_path):
    path = job_file(workspace, "bad-accumulation", gradient_accumulation_steps=50)
    figures, output = launch(["train", str(path)])
    assert figures["code"] == 2 and figures["imported"] == [], output
    errors = [line for line in output.splitlines() if line.startswith("splitstage: error: ")]
    assert len(errors) == 1 and "train.gradient_accumulation_steps=50" in errors[0], output
    assert "Traceback" not in output
    assert not list(workspace.rglob("bad-accumulation/spec.json"))  # refused before the spec


def test_the_childs_error_keeps_its_class_in_process(workspace):
    config = tiny_config(workspace, "missing", 0)
    config.models["dit"].weights = str(workspace / "nope.safetensors")
    with pytest.raises(ConfigError, match=r"models.dit.weights: file .*nope.safetensors"):
        train(config, run_root=workspace / "runs", env=ENV, on_line=lambda line: None)


def test_a_class_from_a_module_the_launcher_imported_is_kept(workspace, tmp_path):
    config = tiny_config(workspace, "no-cache", 0)
    config.cache.url = str(tmp_path / "empty-cache")  # preprocess never ran for it
    with pytest.raises(StaleCacheError, match="run `splitstage preprocess CONFIG` first"):
        train(config, run_root=workspace / "runs", env=ENV, on_line=lambda line: None)


def test_a_bug_in_the_child_comes_back_with_its_traceback(tmp_path):
    request, reply = tmp_path / "request.json", tmp_path / "reply.json"
    request.write_text(json.dumps({"config": {}}))  # no run id: a KeyError, not bad input
    module = "splitstage.tasks.stage2.prepare"
    done = subprocess.run([sys.executable, "-m", module, str(request), str(reply)], timeout=120)
    answer = json.loads(reply.read_text())["error"]
    assert done.returncode == 1 and answer["kind"] == "bug"
    with pytest.raises(PrepareError, match=r"(?s)Traceback.*KeyError: 'run_id'"):
        raise_reply(answer, done.returncode)


@pytest.mark.parametrize(
    ("nproc", "set_up"),  # a one-process job's rank runs the set-up itself, first
    [(1, "stage2.worker --set-up-first"), (2, "stage2.prepare")],
)
def test_cancelling_during_set_up_ends_the_child(workspace, nproc, set_up):
    cancel = threading.Event()
    cancel.set()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    config = tiny_config(workspace, "cancelled", 0, nproc_per_node=nproc)
    with pytest.raises(TorchrunError) as stopped:
        train(config, run_root=workspace / "runs", env=ENV, cancel=cancel, on_line=print)
    assert stopped.value.result.cancelled
    assert set_up in " ".join(stopped.value.result.command)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert not (workspace / "runs/cancelled/spec.json").exists()


def set_up_child(launcher: subprocess.Popen) -> psutil.Process:
    """The launcher's set-up child, once it has started (it runs for seconds: torch, the plan)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for proc in psutil.Process(launcher.pid).children(recursive=True):
            try:
                line = " ".join(proc.cmdline())
                if "stage2.prepare" in line or "stage2.worker --set-up-first" in line:
                    return proc
            except psutil.Error:
                continue
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.05)
    raise AssertionError("no set-up child started")


def gone(proc: psutil.Process, seconds: float = 20) -> bool:
    """Whether `proc` ended (or is a zombie) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_ctrl_c_or_a_killed_launcher_during_set_up_ends_the_child(workspace, sig):
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}
    path = job_file(workspace, f"stopped-{sig.name}")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "splitstage.cli", "train", str(path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    child = set_up_child(launcher)
    os.kill(launcher.pid, sig)  # Ctrl-C reaches the launcher only: the child has its session
    out, err = launcher.communicate(timeout=60)
    assert gone(child), child
    if sig == signal.SIGINT:
        assert launcher.returncode == 130, err
        assert err.strip().splitlines()[-1] == "splitstage: interrupted" and "Traceback" not in err
    assert not list(workspace.rglob(f"stopped-{sig.name}/spec.json"))


def test_the_set_up_the_child_runs_reads_no_weights(workspace, tmp_path):
    """`prepare` (what the child runs) in this process, watched: configs and headers only."""
    config = tiny_config(workspace, "no-weights-set-up", 0)
    with weight_loads() as seen:
        prepared = prepare(make_plan(config), "no-weights-set-up", tmp_path / "runs", tmp_path)
    assert seen == []
    assert prepared["cache_key"] and prepared["split"]["v1"] is not None
    json.dumps(prepared)  # all of it goes through JSON to the launcher


def test_errors_come_back_as_the_nearest_class_this_process_has():
    classes = [
        ["no.such.module", "StaleCacheError"],
        ["splitstage.config.base_group", "ConfigError"],
        ["splitstage.splitter.errors", "UserError"],
    ]
    error = user_error("cache.url: bad", classes)
    assert type(error) is ConfigError and str(error) == "cache.url: bad"
    assert type(user_error("x", [["builtins", "ValueError"]])) is UserError
    with pytest.raises(OSError) as full:
        raise_reply({"kind": "os", "errno": 28, "strerror": "No space", "filename": "/x"}, 2)
    assert full.value.errno == 28 and full.value.filename == "/x"
    with pytest.raises(PrepareError, match="killed by SIGKILL"):
        raise_reply(None, -9)
    with pytest.raises(PrepareError, match="(?s)Traceback.*KeyError"):
        raise_reply({"kind": "bug", "traceback": "Traceback ...\nKeyError: 'x'"}, 1)
