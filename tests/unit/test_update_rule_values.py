"""Training-step settings refused before any model loads, by every command: optimizer argument
values outside what each optimizer documents, schedule arguments the chosen schedule does not take
or of the wrong type, a switched optimizer on resume; changed optimizer arguments apply on resume;
`mixed_precision = "fp16"` on a CPU computes in fp32, as the warning says."""

from __future__ import annotations

import pytest
import torch

from splitstage.cli import main
from splitstage.config.job import ConfigError, config_from_dict
from splitstage.tasks.device import pick_dtype
from splitstage.tasks.stage2.optimization import apply_config_to_groups, check_update_rule
from splitstage.tasks.stage2.resume import ResumeConfigError, compare, run_settings
from tests.helpers.toml_job import toml

REFUSED = [  # (train fields, fragments of the one line)
    ({"optimizer_args": {"betas": [1.5, 0.9]}}, ["betas = [1.5, 0.9]", "each in [0, 1)"]),
    ({"optimizer_args": {"betas": [0.9]}}, ["betas = [0.9]", "two numbers [beta1, beta2]"]),
    ({"optimizer_args": {"eps": 0}}, ["eps = 0", "(0, inf)", "as adamw documents"]),
    ({"optimizer_args": {"amsgrad": "yes"}}, ["amsgrad", "true or false"]),
    ({"optimizer": "adamw8bit", "optimizer_args": {"optim_bits": 4}}, ["optim_bits", "[8, 32]"]),
    ({"optimizer": "prodigy", "optimizer_args": {"d_coef": -1}}, ["d_coef = -1", "(0, inf)"]),
    ({"optimizer": "prodigy", "optimizer_args": {"d_coef": "big"}}, ['d_coef = "big"', "number"]),
    ({"optimizer": "prodigy", "optimizer_args": {"betas": [0.9, 1.0]}}, ["betas", "[0, 1)"]),
    ({"optimizer": "prodigy", "optimizer_args": {"slice_p": 0}}, ["slice_p", ">= 1"]),
    ({"optimizer": "adafactor", "optimizer_args": {"beta1": 5}}, ["beta1 = 5", "[0, 1)"]),
    ({"optimizer": "adafactor", "optimizer_args": {"relative_step": True}}, ["relative_step"]),
    ({"optimizer": "adafactor", "optimizer_args": {"warmup_init": True}}, ["warmup_init"]),
    ({"optimizer": "adafactor", "optimizer_args": {"eps": [1e-30]}}, ["eps", "two numbers"]),
    ({"optimizer": "adafactor", "optimizer_args": {"decay_rate": 0.8}}, ["decay_rate", "0)"]),
    (
        {"lr_scheduler": "cosine", "lr_scheduler_args": {"num_cycles": 3}},
        ["num_cycles is taken by the cosine_with_restarts schedule", "'cosine'"],
    ),
    (
        {"lr_scheduler": "linear", "lr_scheduler_args": {"power": 2.0}},
        ["power is taken by the polynomial schedule", "'linear'"],
    ),
    (
        {"lr_scheduler": "cosine_with_restarts", "lr_scheduler_args": {"num_cycles": "three"}},
        ['num_cycles = "three"', "whole number"],
    ),
    (
        {"lr_scheduler": "polynomial", "lr_scheduler_args": {"power": -1}},
        ["power = -1", "(0, inf)"],
    ),
    ({"lr_scheduler_args": {"lr_end": 0.1}}, ["lr_end is not a schedule argument"]),
]
ACCEPTED = [
    {"optimizer_args": {"betas": [0.9, 0.99], "eps": 1e-6, "amsgrad": True}},
    {"optimizer": "prodigy", "learning_rate": 1.0, "optimizer_args": {"d_coef": 0.5}},
    {"optimizer": "adafactor", "optimizer_args": {"beta1": 0.9, "relative_step": False}},
    {"lr_scheduler": "cosine_with_restarts", "lr_scheduler_args": {"num_cycles": 3}},
    {"lr_scheduler": "polynomial", "lr_scheduler_args": {"power": 2}},
]


@pytest.mark.parametrize(("train", "needles"), REFUSED)
def test_values_outside_the_documented_ranges_are_refused_on_load(train, needles):
    with pytest.raises(ConfigError) as raised:
        config_from_dict({"train": train})
    message = str(raised.value)
    assert "\n" not in message and message.startswith("config: train."), message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("train", ACCEPTED)
def test_documented_values_pass(train):
    config = config_from_dict({"train": train})
    check_update_rule(config.train, optimizer_package=False)


@pytest.mark.parametrize("command", ["validate", "preprocess", "train"])
def test_every_command_refuses_before_loading_anything(command, tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text(toml({"train": {"optimizer_args": {"betas": [1.5, 0.9]}}}))
    assert main([command, str(job)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"splitstage: error: {job}: "), err
    assert "train.optimizer_args: betas = [1.5, 0.9]" in err[0]
    assert not (tmp_path / "runs").exists()


def settings(**train):
    """The settings a checkpoint records for a job with these [train] fields."""
    config = config_from_dict({"train": train})
    return run_settings(config, data_parallel=1, samples="s", lora_targets=[])


def test_switching_the_optimizer_on_resume_is_refused_in_one_line():
    with pytest.raises(ResumeConfigError) as raised:
        compare(settings(), settings(optimizer="prodigy"), step=4, checkpoint_url="/ck")
    message = str(raised.value)
    assert "train.optimizer changed 'adamw' -> 'prodigy' since checkpoint step 4" in message
    assert "restore train.optimizer = 'adamw'" in message and "--run-id" in message
    assert "/ck" in message and "\n" not in message


def test_changed_optimizer_args_apply_on_resume():
    old, new = settings(), settings(optimizer_args={"betas": [0.8, 0.95], "eps": 1e-6})
    said = compare(old, new, step=2, checkpoint_url="/ck")
    assert any(line.startswith("train.optimizer_args changed {} -> ") for line in said), said
    param = torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.AdamW([param], lr=1e-3).state_dict()  # the checkpoint's groups
    resumed = torch.optim.AdamW([param], lr=1e-3)
    resumed.load_state_dict(saved)
    train = config_from_dict({"train": {"optimizer_args": {"betas": [0.8, 0.95], "eps": 1e-6}}})
    apply_config_to_groups(resumed, train.train)
    group = resumed.param_groups[0]
    assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6  # not the checkpoint's


def test_fp16_on_a_cpu_computes_in_fp32_as_said():
    cpu = torch.device("cpu")
    assert pick_dtype("fp16", cpu) == torch.float32
    assert pick_dtype("bf16", cpu) == torch.bfloat16
    assert pick_dtype("fp16", torch.device("cuda", 0)) == torch.float16


def test_fp16_on_a_cpu_holds_and_steps_in_fp32(tmp_path):
    from tests.helpers.stage2_step import (
        demo_config,
        demo_files,
        seed_adapters,
        step_loss,
        trained_model,
    )

    root = demo_files(tmp_path)
    losses = []
    for precision in ("fp16", "no"):
        lines: list[str] = []
        plan, model = trained_model(demo_config(root, mixed_precision=precision), lines)
        assert lines == ["dit: frozen base fp32, trained params fp32"], lines
        seed_adapters(model)
        losses.append(step_loss(plan, model))
    assert torch.equal(losses[0], losses[1])  # what runs is fp32, as the warning says
