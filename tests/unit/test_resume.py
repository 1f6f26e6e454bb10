"""Resuming exactly: the epoch's position in samples survives a change of world size or batch
size (each sample of the epoch seen once), and config changes are applied or refused by class."""

from __future__ import annotations

import pytest

from splitstage.config.job import config_from_dict
from splitstage.tasks.cache.reader import epoch_order
from splitstage.tasks.stage2.resume import ResumeConfigError, compare, run_settings

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
