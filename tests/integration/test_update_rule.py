"""The update rule of a run: each optimizer and schedule trains, checkpoints and resumes bitwise;
the pre-clip gradient norm is recorded and clipping bounds it; the EMA of the trained weights
resumes and is exported beside them, is said and set aside when removed at a resume, and starts
at the resume update when added there; bad settings are one line before launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitstage.config.job import ConfigError, TrainConfig
from splitstage.process.torchrun import TorchrunError
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage2 import optimization
from splitstage.tasks.stage2.checkpoint import read_extra_state
from splitstage.tasks.stage2.optimization import check_update_rule, clip_gradients
from splitstage.tasks.stage2.run_records import launches, read_metrics
from tests.helpers import catalogue
from tests.helpers.catalogue import check_one_line, config_text, run_cli
from tests.helpers.tiny_job import make_workspace, tiny_config

assets = catalogue.assets  # the shared module-scoped fixture

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu"}
# Each optimizer with another schedule, so every optimizer and every schedule runs once.
RULES = {
    "adamw": {"lr_scheduler": "cosine_with_restarts", "lr_scheduler_args": {"num_cycles": 2}},
    "adamw8bit": {"lr_scheduler": "linear"},
    "prodigy": {"lr_scheduler": "constant", "learning_rate": 1.0, "warmup_steps": 2},
    "adafactor": {"lr_scheduler": "polynomial", "lr_scheduler_args": {"power": 2.0}},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("update-rule"), samples=24, seed=5)


def metrics(report) -> list[dict]:
    return read_metrics(Path(report.run_dir))


def launch(workspace: Path, name: str, env=ENV, said=None, **fields):
    config = tiny_config(workspace, name, 5, **{"max_steps": 4, "checkpoint_every": 2, **fields})
    on_line = said.append if said is not None else lambda line: None
    return train(config, run_root=workspace / "runs", env=env, on_line=on_line)


@pytest.mark.parametrize("optimizer", sorted(RULES))
def test_each_optimizer_and_schedule_resumes_bitwise(workspace, optimizer):
    fields = {"optimizer": optimizer, **RULES[optimizer]}
    if optimizer == "adamw":  # the EMA rides along once: resumed and exported exactly too
        fields["ema"] = {"decay": 0.9, "start_update": 1}
    reference = launch(workspace, f"{optimizer}-ref", **fields)
    with pytest.raises(TorchrunError):  # rank 0 SIGKILLs itself after update 3
        launch(
            workspace, f"{optimizer}-crash", env={**ENV, "SPLITSTAGE_FAULT_KILL": "0:3"}, **fields
        )
    resumed = launch(workspace, f"{optimizer}-crash", **fields)
    assert resumed.losses == reference.losses
    # the run's record keeps the crashed launch's updates; the resumed launch redid update 3
    assert [m["lr"] for m in metrics(resumed)] == [m["lr"] for m in metrics(reference)]
    assert [m["loss"] for m in metrics(resumed)] == reference.losses
    assert [s["start"] for s in launches(Path(resumed.run_dir))] == [0, 2]
    for label, url in reference.outputs.items():
        want, got = load_file(url), load_file(resumed.outputs[label])
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), label
    rates = [m["lr"] for m in metrics(reference)]
    assert len(set(rates)) > 1 or optimizer == "prodigy"  # a schedule, not a constant
    if "ema" in fields:  # once: a finished run launched again trains nothing and loses no record
        again = launch(workspace, f"{optimizer}-crash", **fields)
        assert again.updates == 4 and metrics(again) == metrics(resumed)
        assert [s["start"] for s in launches(Path(again.run_dir))] == [0, 2, 4]
        assert set(reference.outputs) == {"dit", "dit_ema"}
        trained, average = (
            load_file(reference.outputs["dit"]),
            load_file(reference.outputs["dit_ema"]),
        )
        assert trained.keys() == average.keys()
        assert any(not torch.equal(trained[k], average[k]) for k in trained)
        ema_removed_then_added(workspace, f"{optimizer}-crash", fields, resumed)


def ema_removed_then_added(workspace: Path, name: str, fields: dict, finished) -> None:
    """[train.ema] removed at a resume: said, and the earlier launch's average is set aside, not
    left beside newer weights; added again: said, and it starts at the resume update."""
    plain = {k: v for k, v in fields.items() if k != "ema"}
    said: list[str] = []
    off = launch(workspace, name, said=said, max_steps=5, **plain)
    stale = Path(finished.outputs["dit_ema"])
    assert any("[train.ema] removed since checkpoint step 4" in line for line in said), said
    assert any(f"{stale} is an earlier launch's average" in line for line in said), said
    assert set(off.outputs) == {"dit"} and not stale.exists()
    assert load_file(f"{stale}.stale").keys() == load_file(off.outputs["dit"]).keys()
    said.clear()
    on = launch(workspace, name, said=said, max_steps=6, **fields)
    assert any("[train.ema] added since checkpoint step 5" in line for line in said), said
    assert any("starts at update 5 (resumed)" in line for line in said), said
    average = read_extra_state(on.checkpoint_url, 6)["ema"]
    assert (average["optimization_step"], average["update_after_step"]) == (6, 5)
    assert set(on.outputs) == {"dit", "dit_ema"}


def test_grad_norm_is_recorded_and_clipping_bounds_it(workspace):
    free = launch(workspace, "norm-free")
    clipped = launch(workspace, "norm-clipped", max_grad_norm=1e-4)
    norms = [m["grad_norm"] for m in metrics(free)]
    assert all(n > 1e-4 for n in norms)  # so the clipped run really clips
    assert [m["grad_norm"] for m in metrics(clipped)][0] == pytest.approx(norms[0], rel=1e-6)
    assert clipped.losses[1:] != pytest.approx(free.losses[1:], rel=1e-6)


def test_clip_gradients_returns_the_pre_clip_norm_and_bounds_it():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad, params[1].grad = torch.full((3,), 3.0), torch.full((4,), 4.0)
    expected = float(torch.cat([params[0].grad, params[1].grad]).norm())
    assert clip_gradients(params, 1.0) == pytest.approx(expected)
    after = torch.cat([p.grad for p in params]).norm()
    assert float(after) == pytest.approx(1.0, rel=1e-5)
    assert clip_gradients(params, None) == pytest.approx(1.0, rel=1e-5)  # measured, not clipped


@pytest.mark.parametrize(
    ("lines", "needles"),
    [
        ('optimizer = "lion"', ["train.optimizer", "adamw"]),
        ("max_grad_norm = 0", ["train.max_grad_norm", "greater than 0"]),
        ("max_grad_norm = -1.5", ["train.max_grad_norm"]),
        ("[train.ema]\ndecay = 1.0", ["train.ema.decay", "less than 1"]),
        ("[train.ema]\ndecay = 0", ["train.ema.decay", "greater than 0"]),
        ("optimizer_args = { momentum = 0.9 }", ["train.optimizer_args", "momentum"]),
        ("optimizer_args = { lr = 0.1 }", ["train.optimizer_args", "learning_rate"]),
        ('lr_scheduler = "cosine"\nlr_scheduler_args = { lr_end = 0.1 }', ["lr_end"]),
        (
            'lr_scheduler = "cosine"\nlr_scheduler_args = { num_cycles = 2 }',
            ["train.lr_scheduler_args", "num_cycles", "cosine_with_restarts", "ignored"],
        ),
        (
            'lr_scheduler = "linear"\nlr_scheduler_args = { power = 2.0 }',
            ["train.lr_scheduler_args", "power", "polynomial", "ignored"],
        ),
        ('parallelism = "fsdp"\n[train.ema]\ndecay = 0.99', ["[train.ema]", "fsdp"]),
    ],
)
def test_bad_update_rules_are_one_line_before_launch(assets, tmp_path, capsys, lines, needles):
    path = tmp_path / "job.toml"
    path.write_text(config_text(assets, extra=f"[train]\n{lines}\n"))
    code, err = run_cli(["validate", str(path)], capsys)
    check_one_line(code, err, *needles)


def test_an_optimizer_whose_package_is_missing_is_named(monkeypatch):
    # The check looks the package up; a name no environment has stands for a missing install.
    monkeypatch.setitem(optimization.OPTIMIZERS, "prodigy", ("no_such_pkg", "prodigyopt", "x:y"))
    with pytest.raises(ConfigError, match=r"needs the prodigyopt package.*pip install prodigyopt"):
        check_update_rule(TrainConfig(optimizer="prodigy"))
