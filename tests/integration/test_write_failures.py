"""Write failures of checkpoints, exports and cache shards on real file systems: one line naming the
place and the cause, exit 2, the last good checkpoint intact.

- ENOSPC: a small tmpfs mounted in a private mount namespace (`unshare --user --map-root-user
  --mount`: no root needed where user namespaces are allowed; skipped, with the reason, where
  not), for one process and for two torchrun ranks (DCP pickles a rank's failure to the others
  without the OSError behind torch's `inline_container.cc ... unexpected pos`), and through the CLI
  for a full fine-tune whose second checkpoint does not fit.
- EFBIG: the process's file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) on any disk.
- EROFS: a read-only tmpfs: `preprocess` says so in one line, before indexing the data set.
Nothing is simulated: the kernel returns each error.

Run: .venv/bin/python -m pytest -q -m slow tests/integration/test_write_failures.py
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.toml_job import toml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
NAMESPACE = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]


def in_small_disk(mount: Path, size: str, command: list[str], *, options: str = "", **kw):
    """Run `command` in a private mount namespace where `mount` is a fresh tmpfs of `size`
    (`options`: more mount options, e.g. 'ro'); skip where this machine allows no namespace."""
    mount.mkdir(parents=True, exist_ok=True)
    opts = ",".join(o for o in (f"size={size}", options) if o)
    script = f'mount -t tmpfs -o {opts} tmpfs "{mount}" || exit 97; exec "$@"'
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            [*NAMESPACE, script, "sh", *command],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            **kw,
        )
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    if done.returncode == 97 or "unshare failed" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {done.stderr.strip()}")
    return done


CHECKPOINT_ON_A_SMALL_DISK = textwrap.dedent(
    """
    import json, os, shutil, sys, torch
    import torch.distributed as dist
    from splitstage.storage.files import StorageFullError
    from splitstage.tasks.stage2.checkpoint import (
        latest_checkpoint, load_checkpoint, save_checkpoint
    )

    root = sys.argv[1] + "/ck"
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB; with AdamW's two states 12 MiB a checkpoint
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.rand(2, 1024)).sum().backward()
    optimizer.step()
    save_checkpoint(root, 1, model, optimizer, {"update": 1})
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    free = shutil.disk_usage(sys.argv[1]).free
    with torch.no_grad():
        model.weight.add_(1.0)
    out = {"free_before": free}
    try:
        save_checkpoint(root, 2, model, optimizer, {"update": 2})
    except StorageFullError as error:
        out.update(error=str(error), errno=error.errno, cls=type(error).__name__)
    out["latest"] = latest_checkpoint(root, clean=False)
    out["folders"] = sorted(os.listdir(root))
    load_checkpoint(root, 1, model, optimizer)
    out["restored"] = all(torch.equal(model.state_dict()[k], v) for k, v in kept.items())
    out["free_after"] = shutil.disk_usage(sys.argv[1]).free
    rank = int(os.environ.get("RANK", 0))
    # one write of under PIPE_BUF bytes: the two ranks' lines never interleave on the pipe
    os.write(1, ("RESULT" + str(rank) + " " + json.dumps(out) + "\\n").encode())
    """
)


def results(stdout: str) -> dict[str, dict]:
    """{rank: its result} from the script's RESULT lines."""
    return {
        line[6 : line.index(" ")]: json.loads(line.split(" ", 1)[1])
        for line in stdout.splitlines()
        if line.startswith("RESULT")
    }


def assert_full_and_kept(out: dict, where: str) -> None:
    """One line naming the checkpoint and ENOSPC; step 1 listed, loadable, equal; space back."""
    assert out.get("cls") == "StorageFullError", out
    message = out["error"]
    assert "\n" not in message and "inline_container" not in message, message
    assert f"{where}/ck/step-00000002" in message and "no space left on device" in message
    assert "(ENOSPC)" in message and "step-00000001, is intact" in message
    assert out["errno"] == 28 and out["latest"] == 1 and out["restored"]
    assert out["folders"] == ["step-00000001"], out["folders"]  # the unfinished one deleted
    assert out["free_after"] >= out["free_before"] - 64 * 1024  # its space came back


def test_a_checkpoint_that_does_not_fit_keeps_the_last_one(tmp_path):
    disk = tmp_path / "disk"
    script = tmp_path / "ck.py"
    script.write_text(CHECKPOINT_ON_A_SMALL_DISK)
    done = in_small_disk(disk, "20m", [PYTHON, str(script), str(disk)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_full_and_kept(results(done.stdout)["0"], str(disk))


def test_two_ranks_both_say_the_disk_is_full(tmp_path):
    """The rank whose file failed sends DCP a pickled failure: without the OSError kept by the
    writer, the other rank saw only torch's 'unexpected pos' (and the old check: free < 1 MiB)."""
    disk = tmp_path / "disk"
    script = tmp_path / "ck.py"
    script.write_text(CHECKPOINT_ON_A_SMALL_DISK)
    run = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), str(disk)]
    done = in_small_disk(disk, "20m", run)
    assert done.returncode == 0, done.stderr[-3000:]
    found = results(done.stdout)
    assert sorted(found) == ["0", "1"], done.stdout
    for out in found.values():
        assert out.get("cls") == "StorageFullError", out
        assert "no space left on device" in out["error"] and out["latest"] == 1


WRITES_OVER_THE_LIMIT = textwrap.dedent(
    """
    import json, sys, torch
    from splitstage.storage.files import StorageError, open_fs, storage_errors, write_atomic
    from splitstage.tasks.cache.store import CacheStore
    from splitstage.tasks.stage2.checkpoint import save_checkpoint

    root, out = sys.argv[1], {}
    def attempt(name, write):
        try:
            write()
            out[name] = None
        except StorageError as error:
            out[name] = [type(error).__name__, error.errno, str(error)]
    model = torch.nn.Linear(512, 512)  # 1 MiB of weights
    attempt("checkpoint", lambda: save_checkpoint(root + "/ck", 1, model, None, save_rng=False))
    samples = {"%064x" % i: {"x": torch.rand(64 * 1024)} for i in range(2)}  # 512 KiB
    attempt("cache", lambda: CacheStore(root + "/cache", "ck").write_shard(samples))
    fs, path = open_fs(root + "/out")
    def export():
        with storage_errors(root + "/out/dit.safetensors", "write the export", field="output.url"):
            write_atomic(fs, path + "/dit.safetensors", bytes(1 << 20))
    attempt("export", export)
    print(json.dumps(out))
    """
)


def _limited() -> None:
    """In the child: a 256 KiB file size limit; SIGXFSZ ignored, so writes fail with EFBIG."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


def test_a_file_over_the_size_limit_is_one_line_for_every_writer(tmp_path):
    script = tmp_path / "limit.py"
    script.write_text(WRITES_OVER_THE_LIMIT)
    done = subprocess.run(
        [PYTHON, str(script), str(tmp_path / "w")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=_limited,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for what, where in (
        ("checkpoint", "/ck/step-00000001"),
        ("cache", "/cache/ck"),
        ("export", ""),
    ):
        cls, code, message = out[what]
        assert cls == "StorageFullError" and code == 27, out[what]  # EFBIG
        assert "file too large" in message and "(EFBIG)" in message and "\n" not in message
        assert f"{tmp_path}/w{where}" in message, message
    assert not list((tmp_path / "w" / "cache").rglob("*.tmp-*"))  # nothing half-written left


def demo_job(tmp_path: Path, cache: Path, output: Path, **train) -> Path:
    """A demo job (digits, demo weights) as a TOML file; a full fine-tune of the DiT."""
    from pipelines.demo.weight_files import build_demo_weights
    from splitstage.data.digits import write_digits_dataset

    assets = tmp_path / "assets"
    if not assets.exists():
        write_digits_dataset(assets / "data", limit=8)
        build_demo_weights(assets / "weights")
    job = {
        "models": {
            "vae": {"weights": str(assets / "weights/vae.safetensors")},
            "dit": {"weights": str(assets / "weights/dit.safetensors")},
            "text_encoder": {"builder": "tiny"},
        },
        "trainable": {"full": ["dit"]},
        "data": {"base_path": str(assets / "data")},
        "cache": {"url": str(cache), "shard_samples": 8},
        "output": {"url": str(output)},
        "preprocess": {"batch_size": 4, "workers": 1},
        "train": {"batch_size": 4, **train},
    }
    path = tmp_path / "job.toml"
    path.write_text(toml(job))
    return path


def test_train_on_a_disk_that_fills_says_so_and_exits_2(tmp_path):
    """A full fine-tune of the demo DiT (12.5 MB; ~38 MB a checkpoint with AdamW) on a 60 MiB
    output disk: the first checkpoint fits, the second does not."""
    disk = tmp_path / "disk"
    job = demo_job(tmp_path, tmp_path / "cache", disk / "out", max_steps=3, checkpoint_every=1)
    cli = [PYTHON, "-m", "splitstage.cli"]
    script = (
        f'{" ".join(cli)} preprocess "{job}" >/dev/null 2>&1 && exec {" ".join(cli)} train "{job}"'
    )
    done = in_small_disk(disk, "60m", ["sh", "-c", script])
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("splitstage: error: training stopped: cannot write checkpoint "), last
    assert f"{disk}/out/splitstage-job/checkpoints/step-00000002" in last
    assert "no space left on device" in last and "step-00000001, is intact" in last
    assert "Traceback" not in done.stderr and "inline_container" not in done.stderr


def test_preprocess_into_a_read_only_cache_is_one_line(tmp_path):
    disk = tmp_path / "ro"
    job = demo_job(tmp_path, disk / "cache", tmp_path / "out")
    cli = [PYTHON, "-m", "splitstage.cli", "preprocess", str(job)]
    done = in_small_disk(disk, "1m", cli, options="ro")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines  # no "hash memo ... not written" lines before it
    assert lines[0].startswith(f"splitstage: error: cannot write {disk}/cache/"), lines
    assert "read-only file system" in lines[0] and "(EROFS)" in lines[0]
