"""How stage-2 processes leave: the worker (code, output kept, stacks on signals), the agent."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts servers or processes (docs/tests.md)

LEAVE = (
    "import sys\n"
    "from splitstage.process.leaving import leave\n"
    "print('written', end='')\n"
    "print('to stderr', end='', file=sys.stderr)\n"
    "leave(3)\n"
    "print('never')\n"
)

TRACES = (
    "import faulthandler\n"
    "from splitstage.tasks.stage2.worker import main\n"
    "try:\n"
    "    main(['/nonexistent/spec.json'])\n"
    "except FileNotFoundError:\n"
    "    print(faulthandler.is_enabled(), end='')\n"
)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_leave_keeps_the_exit_code_and_flushes_piped_output():
    done = run(LEAVE)
    assert done.returncode == 3
    assert done.stdout == "written"  # block-buffered on a pipe: lost by a bare os._exit
    assert done.stderr == "to stderr"


def test_a_rank_shows_its_python_stack_if_a_signal_kills_it():
    done = run(TRACES)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True"  # faulthandler: SIGABRT/SIGSEGV print every thread's frames


AGENT_WITH_A_THREAD_LEFT = (
    "import sys, threading\n"
    "import torch.distributed.run as torchrun\n"
    "from splitstage.process import torchrun_agent as agent\n"
    "def main(args):\n"  # torchrun returns, a thread it started still waiting (its log tails)
    "    threading.Thread(target=threading.Event().wait).start()\n"
    "    raise SystemExit(int(args[0]))\n"
    "torchrun.main = main\n"
    "sys.argv = ['agent', sys.argv[1]]\n"
    "agent.main()\n"
)


def test_the_torchrun_agent_exits_with_its_code_though_a_thread_is_left():
    for code in (0, 3):
        done = subprocess.run(
            [sys.executable, "-c", AGENT_WITH_A_THREAD_LEFT, str(code)],
            capture_output=True,
            text=True,
            timeout=120,  # a plain interpreter exit would wait for the thread forever
        )
        assert done.returncode == code, done.stderr


def test_the_torchrun_agent_runs_torchrun(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nprint('rank', os.environ['RANK'])\nsys.exit(0)\n")
    agent = [sys.executable, "-m", "splitstage.process.torchrun_agent", "--standalone"]
    ok = subprocess.run(
        [*agent, "--nproc-per-node=1", str(script)], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0 and "rank 0" in ok.stdout, ok.stderr
    script.write_text("import sys\nsys.exit(5)\n")
    failed = subprocess.run(
        [*agent, "--nproc-per-node=1", str(script)], capture_output=True, text=True, timeout=120
    )
    assert failed.returncode == 1
    assert "ChildFailedError" in failed.stderr and "exitcode" in failed.stderr


CONSOLE = (
    "import atexit, sys\n"
    "import splitstage.cli as cli\n"
    "class Finalized:\n"  # a module global's __del__ runs in the interpreter's finalization
    "    def __del__(self):\n"
    "        print('finalized', flush=True)\n"
    "kept = Finalized()\n"
    "real_main = cli.main\n"
    "def main(argv=None, **options):\n"  # a handler registered while a command runs (Prefect's)
    "    atexit.register(print, 'exit handler ran')\n"
    "    return real_main(argv, **options)\n"
    "cli.main = main\n"
    "sys.argv = ['splitstage', *sys.argv[1:]]\n"
    "cli.console()\n"
)


def test_the_console_script_runs_exit_handlers_then_skips_finalization():
    """The CLI leaves with its code after the exit handlers, without the interpreter's
    finalization (where a thread that ran torch ops can abort the process: exit 134)."""
    for args, code in (
        (["validate", "/nonexistent/job.toml"], 2),  # a user error: one line
        (["bogus"], 2),  # argparse's usage error
        (["--help"], 0),
        (["families"], 0),
    ):
        done = subprocess.run(
            [sys.executable, "-c", CONSOLE, *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == code, (args, done.stderr)
        assert done.stdout.rstrip().endswith("exit handler ran"), (args, done.stdout)
        assert "finalized" not in done.stdout, args


LORA_AFTER = (
    "import sys\n"
    "from splitstage.process.unused_imports import skip_unused_libraries\n"
    "skip_unused_libraries({'train': {'optimizer': %r}})\n"
    "import torch\n"
    "from peft import LoraConfig, inject_adapter_in_model\n"
    "model = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
    "inject_adapter_in_model(LoraConfig(r=2, target_modules=['0']), model)\n"
    "print(sys.modules.get('bitsandbytes') is not None, end='')\n"
)


def test_a_rank_loads_bitsandbytes_only_for_adamw8bit():
    """peft imports bitsandbytes whenever it is installed; a process of one job (a rank, the
    set-up child, the console script) marks it absent unless the job's optimizer is adamw8bit,
    and peft's LoRA injection then runs without it."""
    for optimizer, loaded in (("adamw", "False"), ("adamw8bit", "True")):
        done = run(LORA_AFTER % optimizer)
        assert done.returncode == 0, done.stderr
        assert done.stdout == loaded, (optimizer, done.stdout)


MARKS = (
    "import argparse, sys\n"
    "from splitstage.cli import skip_what_the_job_cannot_use\n"
    "from splitstage.config.job import config_from_dict\n"
    "config = config_from_dict({'train': {'optimizer': %r}})\n"
    "skip_what_the_job_cannot_use(argparse.Namespace(one_job=%r), config)\n"
    "print(sys.modules.get('bitsandbytes', 'unset'), end='')\n"
)


def test_only_the_console_scripts_one_job_process_skips_bitsandbytes():
    """`splitstage preprocess|validate` (one job, then exit) skip it unless the job uses
    adamw8bit; `main` called in a longer-lived process (a flow, a test) never does."""
    for optimizer, one_job, shown in (
        ("adamw", True, "None"),
        ("adamw8bit", True, "unset"),
        ("adamw", False, "unset"),
    ):
        done = run(MARKS % (optimizer, one_job))
        assert done.returncode == 0, done.stderr
        assert done.stdout == shown, (optimizer, one_job, done.stdout)


ACCELERATOR_AFTER = (
    "import sys\n"
    "from splitstage.process.unused_imports import skip_unused_libraries\n"
    "skip_unused_libraries(%r)\n"
    "from accelerate import Accelerator\n"
    "Accelerator(cpu=True)\n"
    "print(sys.modules.get('boto3', 'unset') is None, 'botocore' in sys.modules, end='')\n"
)


def test_a_rank_loads_boto3_only_for_a_credentials_block():
    """accelerate imports boto3 (its SageMaker settings) whenever it is installed; a process of
    one job marks it absent unless the config names a Prefect credentials block (read through
    prefect-aws's boto3 sessions), and accelerate then builds its Accelerator without it."""
    block = {"data": {"credentials_block": "aws-credentials/mine"}}
    handed_on = {"cache": {"storage_options": {"credentials_block": {"name": "s3-bucket/b"}}}}
    for config, skipped in (({}, "True False"), (block, "False True"), (handed_on, "False True")):
        done = run(ACCELERATOR_AFTER % (config,))
        assert done.returncode == 0, done.stderr
        assert done.stdout == skipped, (config, done.stdout)
