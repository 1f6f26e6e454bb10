"""Resuming exactly: the epoch's position in samples survives a change of world size or batch
size (each sample of the epoch seen once), and config changes are applied or refused by class:
[train.ema] changes are said as the trainer applies them, a switched train.task is refused."""

from __future__ import annotations

import pytest

from splitstage.config.job import config_from_dict
from splitstage.tasks.cache.reader import epoch_order
from splitstage.tasks.stage2.resume import (
    ResumeConfigError,
    average_start,
    check_resume_identity,
    compare,
    run_settings,
)

KEYS = [f"{i:04x}" for i in range(103)]


def consumed(world: int, batch: int, updates: int, offset: int = 0, epoch: int = 0) -> list[str]:
    """The samples `updates` updates of `batch` per rank on `world` ranks read, from `offset`."""
    per_rank = [epoch_order(KEYS, epoch, 5, r, world, offset) for r in range(world)]
    return [k for order in per_rank for k in order[: updates * batch]]


@pytest.mark.parametrize(("world", "batch"), [(1, 4), (2, 3), (3, 2), (4, 5)])
@pytest.mark.parametrize(("new_world", "new_batch"), [(1, 7), (2, 2), (3, 3)])
def test_a_resumed_epoch_sees_each_sample_once(world, batch, new_world, new_batch):
    before = consumed(world, batch, updates=3)
    offset = len(before)  # what the checkpoint records: samples consumed by all replicas
    left = (len(KEYS) - offset) // new_world // new_batch
    after = consumed(new_world, new_batch, updates=left, offset=offset)
    assert not set(before) & set(after)  # nothing seen twice
    assert len(set(before) | set(after)) == offset + left * new_world * new_batch
    unseen = set(KEYS) - set(before) - set(after)
    assert len(unseen) < new_world * new_batch + new_world  # only the tail that cannot fill


def test_no_offset_is_the_plain_strided_split():
    order = epoch_order(KEYS, 1, 5, 0, 1)
    assert [epoch_order(KEYS, 1, 5, r, 3) for r in range(3)] == [
        order[: len(KEYS) - len(KEYS) % 3][r::3] for r in range(3)
    ]


def settings(**groups) -> dict:
    config = config_from_dict(
        {"trainable": {"lora_base_model": "dit"}, "models": {"dit": {"builder": "x"}}, **groups}
    )
    return run_settings(config, data_parallel=1, samples="abc", lora_targets=["to_q"])


def test_batch_and_optimizer_changes_are_applied_and_said():
    notes = compare(
        settings(train={"batch_size": 8}),
        settings(train={"batch_size": 4, "learning_rate": 3e-4}),
        step=6,
        checkpoint_url="ckpt",
    )
    assert any("train.batch_size changed 8 -> 4" in n for n in notes)
    assert any("train.learning_rate changed" in n and "update 6" in n for n in notes)
    assert compare(settings(), settings(), step=6, checkpoint_url="ckpt") == []


@pytest.mark.parametrize(
    ("groups", "needle"),
    [
        ({"job": {"seed": 3}}, "job.seed: 0 -> 3"),
        ({"trainable": {"lora_base_model": "dit", "lora_rank": 4}}, "trainable.lora_rank"),
        ({"train": {"mode": "unsplit"}}, "train.mode"),
    ],
)
def test_changes_that_cannot_continue_are_refused(groups, needle):
    with pytest.raises(ResumeConfigError, match=needle) as refused:
        compare(settings(), settings(**groups), step=6, checkpoint_url="out/ckpt")
    assert "another --run-id" in str(refused.value) and "out/ckpt" in str(refused.value)


def test_schedule_clipping_and_precision_changes_are_applied_and_said():
    notes = compare(
        settings(),
        settings(
            train={
                "lr_scheduler": "cosine_with_restarts",
                "lr_scheduler_args": {"num_cycles": 2},
                "max_grad_norm": 1.0,
                "mixed_precision": "no",
            }
        ),
        step=4,
        checkpoint_url="ckpt",
    )
    for field in ("lr_scheduler", "lr_scheduler_args", "max_grad_norm", "mixed_precision"):
        assert any(f"train.{field} changed" in n and "update 4" in n for n in notes), field


def ema(decay: float = 0.9, start_update: int = 0) -> dict:
    return {"train": {"ema": {"decay": decay, "start_update": start_update}}}


@pytest.mark.parametrize(
    ("before", "after", "step", "needles"),
    [
        (ema(0.9), ema(0.5), 6, ["train.ema.decay changed 0.9 -> 0.5", "from update 6 on"]),
        ({}, ema(0.9, 2), 6, ["[train.ema] added", "starts at update 6 (resumed)"]),
        ({}, ema(0.9, 9), 6, ["[train.ema] added", "starts at update 9"]),
        (ema(), {}, 6, ["[train.ema] removed", "no *_ema files", ".stale"]),
        (ema(0.9, 2), ema(0.9, 4), 6, ["start_update changed 2 -> 4", "update 4", "kept"]),
        (ema(0.9, 2), ema(0.9, 8), 6, ["starts at update 8", "so far is dropped"]),
        (ema(0.9, 8), ema(0.9, 2), 6, ["starts at update 6", "averaged nothing yet"]),
    ],
)
def test_ema_changes_are_said_as_the_trainer_applies_them(before, after, step, needles):
    notes = compare(settings(**before), settings(**after), step=step, checkpoint_url="ckpt")
    assert len(notes) == 1
    for needle in needles:
        assert needle in notes[0], (needle, notes[0])


@pytest.mark.parametrize(
    ("saved_start", "start", "step", "expected"),
    [
        (None, 0, 6, 6),  # no average in the checkpoint: it starts at the resume
        (None, 9, 6, 9),
        (2, 2, 6, 2),  # started: the config's start_update
        (2, 8, 6, 8),
        (8, 2, 6, 6),  # not started by the resume: it starts there
        (8, 8, 6, 8),
    ],
)
def test_average_start(saved_start, start, step, expected):
    assert average_start(saved_start, start, step) == expected


def identity(task: str | None) -> dict:
    found = {"family": "demo", "pipeline": "demo", "models": {}}
    return found if task is None else {**found, "task": task}


def test_a_switched_task_is_refused_naming_the_field_and_how_to_start_fresh():
    with pytest.raises(ResumeConfigError) as refused:
        check_resume_identity(
            {"base": identity("sft")}, identity("direct_distill"), step=3, checkpoint_url="ck"
        )
    said = str(refused.value)
    assert "train.task changed 'sft' -> 'direct_distill'" in said
    assert "train.task = 'sft'" in said and "another --run-id" in said and "ck" in said
    assert "\n" not in said
    same = check_resume_identity(
        {"base": identity("sft")}, identity("sft"), step=3, checkpoint_url="ck"
    )
    assert same == []
    (unknown,) = check_resume_identity(
        {"base": identity(None)}, identity("sft"), step=3, checkpoint_url="ck"
    )
    assert "records no train.task" in unknown and "another --run-id" in unknown


def test_the_training_steps_family_settings_are_applied_and_said():
    """A family setting that does not change stage 1 (the demo's caption dropout) is the
    training step's own: a resume applies the new value and says so; one that changes stage 1
    is the cache key's, not recorded here."""
    before = settings(pipeline={"caption_dropout": 0.0})
    after = settings(pipeline={"caption_dropout": 0.2})
    assert "caption_dropout" in before["pipeline"]
    assert not set(before["pipeline"]) & set(config_from_dict({}).pipeline.stage1_settings())
    (note,) = compare(before, after, step=4, checkpoint_url="ckpt")
    assert note == (
        "pipeline.caption_dropout changed 0.0 -> 0.2 since checkpoint step 4: applied from "
        "update 4 on"
    )
