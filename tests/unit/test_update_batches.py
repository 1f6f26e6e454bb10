"""The loop's batch source owns where the run stands: one update's micro-batches at a time, the
epoch and the position within it in `state_dict()`; a source restored from it continues with the
micro-batches the uninterrupted one reads next (with several shape groups: the same samples, the
groups' turns drawn again), also on another world size."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from splitstage.tasks.stage2.batches import PlannedBatches, UpdateBatches

KEYS = [f"{i:04x}" for i in range(37)]


class ListedBatches(PlannedBatches):
    """A planned source over KEYS (in `groups` shape groups) whose batches are their keys."""

    def __init__(self, rank: int = 0, world_size: int = 1, groups: int = 2):
        config = SimpleNamespace(
            job=SimpleNamespace(seed=7),
            train=SimpleNamespace(batch_size=2),
            data=SimpleNamespace(buckets=SimpleNamespace(tail="drop")),
        )
        super().__init__(config, rank, world_size)
        self.keys = KEYS
        self.groups = np.asarray([i % 3 == 0 and groups > 1 for i in range(len(KEYS))], int)
        self.opened = 0

    def iterate(self, epoch, position=0):
        self.opened += 1
        for keys in self.rank_keys(epoch, position):
            yield keys, {"keys": keys}


def read(batches: UpdateBatches, updates: int) -> list[tuple[int, list[list[str]]]]:
    """(epoch, micro-batch keys) of the next `updates` updates."""
    out = []
    for _ in range(updates):
        update = batches.next_update()
        out.append((update.epoch, [keys for keys, _ in update.micro_batches]))
    return out


def test_an_update_is_its_micro_batches_and_an_epoch_ends_on_a_whole_update():
    source = ListedBatches()
    batches = UpdateBatches(source, accumulation=3)
    per_epoch = source.steps_per_epoch() // 3
    assert per_epoch == batches.updates_per_epoch() >= 2
    updates = read(batches, per_epoch)
    assert all(len(micro) == 3 for _, micro in updates)
    assert {epoch for epoch, _ in updates} == {0}
    seen = [key for _, micro in updates for keys in micro for key in keys]
    assert len(seen) == len(set(seen)) == per_epoch * 3 * 2
    # after the epoch's last whole update the position is the next epoch's start
    assert batches.state_dict() == {"epoch": 1, "offset": 0}
    (epoch, _), *_ = read(batches, 1)
    assert epoch == 1


def keys_of(updates) -> list[str]:
    return sorted(key for _, micro in updates for batch in micro for key in batch)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("done", [1, 2, 5, 7])
def test_a_restored_source_continues_with_the_same_micro_batches(done, groups):
    straight = UpdateBatches(ListedBatches(groups=groups), accumulation=2)
    before = read(straight, done)
    state = straight.state_dict()
    left = straight.updates_left()  # of this epoch
    expected = read(straight, left + 2)
    resumed = UpdateBatches(ListedBatches(groups=groups), accumulation=2)
    resumed.load_state_dict(state)
    assert resumed.updates_left() == left
    got = read(resumed, left + 2)
    if groups == 1:
        assert got == expected
    else:  # the rest of the epoch: the same samples, the groups' turns drawn again
        assert keys_of(got[:left]) == keys_of(expected[:left])
        assert not set(keys_of(before)) & set(keys_of(got[:left]))
        assert got[left:] == expected[left:]  # the next epoch from its start: the same


def test_the_position_survives_another_world_size():
    """Two replicas' first updates, then one replica: every sample of the epoch once."""
    two = [UpdateBatches(ListedBatches(rank, 2), accumulation=1) for rank in range(2)]
    seen = [key for batches in two for _, micro in read(batches, 3) for b in micro for key in b]
    states = [batches.state_dict() for batches in two]
    assert states[0] == states[1]
    one = UpdateBatches(ListedBatches(), accumulation=1)
    one.load_state_dict(states[0])
    rest = [key for _, micro in read(one, one.updates_left()) for b in micro for key in b]
    assert not set(seen) & set(rest)
    assert len(set(seen) | set(rest)) > len(KEYS) - 6  # only each group's tail is left out


def test_planned_updates_count_epochs_from_the_position_and_max_steps_caps_them():
    batches = UpdateBatches(ListedBatches(), accumulation=2)
    per_epoch = batches.updates_per_epoch()
    assert batches.planned_updates(0, epochs=3, max_steps=None) == 3 * per_epoch
    assert batches.planned_updates(0, epochs=3, max_steps=4) == 4
    read(batches, 2)
    assert batches.planned_updates(2, epochs=3, max_steps=None) == 3 * per_epoch
    assert batches.planned_updates(2, epochs=1, max_steps=None) == per_epoch


def test_close_stops_reading_and_the_next_update_reopens_at_the_position():
    source = ListedBatches(groups=1)
    batches = UpdateBatches(source, accumulation=2)
    first = read(batches, 2)
    batches.close()
    after = read(batches, 1)
    assert source.opened == 2
    fresh = UpdateBatches(ListedBatches(groups=1), accumulation=2)
    assert list(itertools.chain(first, after)) == read(fresh, 3)
