"""One road through stage 2, and a lean launcher: a real `splitstage train` never imports torch, a
family's libraries or a model in its own process; a one-rank job runs as the launcher and the
rank, a two-rank job as the launcher, torchrun's agent and the two ranks (no set-up child); bad
input found by the ranks' set-up reaches the user as the same one line, once, with its class;
cancelling or killing the launcher during the set-up ends the ranks; the set-up reads no weights."""

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
from splitstage.process.torchrun import TorchrunError
from splitstage.splitter import UserError
from splitstage.tasks.launch.launcher import train, user_error
from splitstage.tasks.stage2.distributed import close_distributed
from splitstage.tasks.stage2.preflight import StaleCacheError
from splitstage.tasks.stage2.run_spec import RunSpecError
from tests.helpers.signals import default_sigint
from tests.helpers.tiny_job import make_workspace, one_rank_setup, tiny_config
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


@pytest.mark.parametrize("nproc", [1, 2])
def test_bad_input_found_by_the_ranks_is_one_line_once_exit_2(workspace, nproc):
    name = f"bad-accumulation-{nproc}"
    path = job_file(workspace, name, gradient_accumulation_steps=50, nproc_per_node=nproc)
    figures, output = launch(["train", str(path)])
    assert figures["code"] == 2 and figures["imported"] == [], output
    said = [line for line in output.splitlines() if "train.gradient_accumulation_steps=50" in line]
    assert said == [said[0]] and said[0].startswith("splitstage: error: "), output  # once
    assert "Traceback" not in output
    out = workspace / "out" / name
    assert not list(out.glob("checkpoints/step-*")) and not list(out.glob("*.safetensors"))


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


def test_a_spec_from_another_version_is_one_line(workspace, tmp_path):
    config = tiny_config(workspace, "versions", 0)
    document = {"version": 2, "config": config.model_dump(mode="json"), "run_id": "v"}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(document))
    from splitstage.tasks.stage2.run_spec import RunSpec

    with pytest.raises(RunSpecError, match=r"run spec .*spec.json: version: .*same splitstage"):
        RunSpec.read(spec)
    rank = [sys.executable, "-m", "splitstage.tasks.stage2.worker", str(spec)]
    done = subprocess.run(rank, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().startswith("splitstage: error: run spec "), done.stderr


@pytest.mark.parametrize(("nproc", "processes"), [(1, 1), (2, 3)])
def test_one_road_no_other_python_process(workspace, nproc, processes):
    """Below the launcher (this process): the rank, or torchrun's agent and its two ranks (a
    server this test process runs already, such as a Prefect test harness's, is not counted)."""
    seen: list[list[str]] = []
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def look(line: str) -> None:
        if "update 1/" in line and not seen:
            kids = psutil.Process().children(recursive=True)
            seen.append([" ".join(p.cmdline()) for p in kids if p.pid not in before])

    config = tiny_config(workspace, f"road{nproc}", 0, batch_size=1, max_steps=2)
    config.train.nproc_per_node = nproc
    report = train(config, run_root=workspace / "runs", env=ENV, on_line=look)
    assert report.updates == 2 and report.world_size == nproc
    assert len(seen[0]) == processes, seen
    ranks = [line for line in seen[0] if "torchrun_agent" not in line]
    assert len(ranks) == nproc and all("-m splitstage.tasks.stage2.worker" in r for r in ranks)


@pytest.mark.parametrize(("nproc", "started"), [(1, "stage2.worker"), (2, "torchrun_agent")])
def test_cancelling_during_set_up_ends_the_ranks(workspace, nproc, started):
    cancel = threading.Event()
    cancel.set()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    config = tiny_config(workspace, "cancelled", 0, nproc_per_node=nproc)
    with pytest.raises(TorchrunError) as stopped:
        train(config, run_root=workspace / "runs", env=ENV, cancel=cancel, on_line=print)
    assert stopped.value.result.cancelled
    assert started in " ".join(stopped.value.result.command)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert not list(workspace.glob("out/cancelled/checkpoints/step-*"))


def set_up_child(launcher: subprocess.Popen) -> psutil.Process:
    """The launcher's rank, once it has started (its set-up runs for seconds: torch, the plan)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for proc in psutil.Process(launcher.pid).children(recursive=True):
            try:
                line = " ".join(proc.cmdline())
                if "stage2.worker" in line:
                    return proc
            except psutil.Error:
                continue
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.05)
    raise AssertionError("no rank started")


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
def test_ctrl_c_or_a_killed_launcher_during_set_up_ends_the_rank(workspace, sig):
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
    os.kill(launcher.pid, sig)  # Ctrl-C reaches the launcher only: the rank has its session
    out, err = launcher.communicate(timeout=60)
    assert gone(child), child
    if sig == signal.SIGINT:
        assert launcher.returncode == 130, err
        assert err.strip().splitlines()[-1] == "splitstage: interrupted" and "Traceback" not in err
    assert not list(workspace.glob(f"out/stopped-{sig.name}/checkpoints/step-*"))


def test_a_ranks_set_up_reads_no_weights(workspace, tmp_path):
    """`set_up_rank` (plan, checks, agreement) in this process, watched: configs and headers."""
    config = tiny_config(workspace, "no-weights-set-up", 0)
    try:
        with weight_loads() as seen:
            setup = one_rank_setup(config, tmp_path / "runs")
    finally:
        close_distributed()
    assert seen == []
    assert setup.plan.cache_key and setup.settings["samples"]


def test_errors_come_back_as_the_nearest_class_this_process_has():
    classes = [
        ["no.such.module", "StaleCacheError"],
        ["splitstage.config.base_group", "ConfigError"],
        ["splitstage.splitter.errors", "UserError"],
    ]
    error = user_error("cache.url: bad", classes)
    assert type(error) is ConfigError and str(error) == "cache.url: bad"
    assert type(user_error("x", [["builtins", "ValueError"]])) is UserError
    assert type(user_error("x", [])) is UserError


def test_a_refusal_record_is_raised_again_as_what_it_was(tmp_path):
    """What `rank_setup.record_refusal` leaves, as the launcher raises it: an OSError keeps its
    errno and path (the CLI names the cause), bad input its class; a later stop is 'stopped'."""
    from splitstage.tasks.launch.launcher import TrainingStoppedError, raise_rank_error
    from splitstage.tasks.stage2.outputs import ERROR_FILE, RunPlaces

    places = RunPlaces(run_dir=str(tmp_path), output_url="s3://b/o", checkpoint_url="s3://b/c")
    record = tmp_path / ERROR_FILE
    full = {"errno": 28, "strerror": "No space left on device", "filename": "/cache/x"}
    record.write_text(json.dumps({"phase": "set-up", "message": "m", "os": full}))
    with pytest.raises(OSError) as error:
        raise_rank_error(tmp_path, places, True)
    assert (error.value.errno, error.value.filename) == (28, "/cache/x")
    classes = [["splitstage.config.base_group", "ConfigError"]]
    record.write_text(json.dumps({"phase": "set-up", "message": "a: b", "classes": classes}))
    with pytest.raises(ConfigError, match="^a: b$"):
        raise_rank_error(tmp_path, places, True)
    record.write_text(json.dumps({"rank": 1, "message": "the loss is nan"}))
    with pytest.raises(TrainingStoppedError, match="^training stopped: the loss is nan$"):
        raise_rank_error(tmp_path, places, True)
