"""Epoch plans over groups of same-shaped samples: one group per batch, exact resumes, tails."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from splitstage.tasks.cache.reader import epoch_order
from splitstage.tasks.stage2.batch_plan import plan_epoch

KEYS = sorted(hashlib.sha256(str(i).encode()).hexdigest() for i in range(97))
GROUPS = np.random.default_rng(0).choice(3, size=len(KEYS), p=[0.6, 0.3, 0.1])


def rank_samples(plan, rank: int, steps: range | None = None) -> list[int]:
    steps = range(len(plan.batches)) if steps is None else steps
    return [int(i) for s in steps for i in plan.rank_batch(s, rank)]


@pytest.mark.parametrize(("replicas", "batch", "offset"), [(1, 4, 0), (2, 3, 0), (3, 2, 7)])
def test_one_group_gives_the_order_epoch_order_gives(replicas, batch, offset):
    plan = plan_epoch(
        [0] * len(KEYS),
        KEYS,
        epoch=2,
        seed=5,
        replicas=replicas,
        batch_size=batch,
        position=offset,
    )
    for rank in range(replicas):
        got = [KEYS[i] for i in rank_samples(plan, rank)]
        old = epoch_order(KEYS, 2, 5, rank, replicas, offset)
        assert got == old[: len(got)] and len(old) - len(got) < batch
    assert plan.position_after(2) == offset + 2 * batch * replicas


def test_every_batch_is_one_group_and_ranks_share_the_step_group():
    plan = plan_epoch(GROUPS, KEYS, epoch=0, seed=1, replicas=2, batch_size=4)
    assert {g for g, _ in plan.batches} == {0, 1, 2}
    for step in range(len(plan.batches)):
        for rank in range(2):
            assert set(GROUPS[plan.rank_batch(step, rank)]) == {GROUPS[plan.batches[step][1][0]]}
    seen = rank_samples(plan, 0) + rank_samples(plan, 1)
    assert len(seen) == len(set(seen)) == len(KEYS) - plan.dropped
    sizes = np.bincount(GROUPS)
    assert plan.dropped == sum(int(n) % 8 for n in sizes)


@pytest.mark.parametrize(("first", "then"), [((2, 3), (1, 2)), ((1, 2), (3, 1)), ((2, 2), (2, 5))])
def test_a_resume_with_another_world_or_batch_size_sees_each_sample_once(first, then):
    replicas, batch = first
    plan = plan_epoch(GROUPS, KEYS, epoch=3, seed=9, replicas=replicas, batch_size=batch)
    done = 3
    seen = [i for r in range(replicas) for i in rank_samples(plan, r, range(done))]
    position = plan.position_after(done)
    assert isinstance(position, dict) and sum(position.values()) == len(seen)
    replicas, batch = then
    rest = plan_epoch(
        GROUPS, KEYS, epoch=3, seed=9, replicas=replicas, batch_size=batch, position=position
    )
    seen += [i for r in range(replicas) for i in rank_samples(rest, r)]
    assert len(seen) == len(set(seen))
    assert len(seen) + rest.dropped == len(KEYS)


def test_the_order_is_seeded_and_changes_every_epoch():
    def order(epoch, seed):
        plan = plan_epoch(GROUPS, KEYS, epoch=epoch, seed=seed, replicas=1, batch_size=2)
        return rank_samples(plan, 0)

    assert order(0, 1) == order(0, 1)
    assert order(0, 1) != order(1, 1) and order(0, 1) != order(0, 2)


def test_repeat_fills_each_groups_last_batch_with_its_first_samples():
    plan = plan_epoch(GROUPS, KEYS, epoch=0, seed=1, replicas=2, batch_size=4, tail="repeat")
    sizes = np.bincount(GROUPS)
    assert plan.dropped == 0
    assert plan.repeated == sum(-int(n) % 8 for n in sizes)
    seen = rank_samples(plan, 0) + rank_samples(plan, 1)
    assert set(seen) == set(range(len(KEYS)))
    assert len(seen) == len(KEYS) + plan.repeated
    assert all(len(indices) == 8 for _, indices in plan.batches)
    assert plan.position_after(len(plan.batches)) == {
        KEYS[int(np.flatnonzero(np.equal(GROUPS, g))[0])]: int(n) for g, n in enumerate(sizes)
    }


def test_positions_that_do_not_fit_the_cache_are_refused():
    with pytest.raises(ValueError, match="plain sample count but the cache holds 3 groups"):
        plan_epoch(GROUPS, KEYS, epoch=0, seed=1, replicas=1, batch_size=1, position=5)
    with pytest.raises(ValueError, match="groups the cache does not have"):
        plan_epoch(GROUPS, KEYS, epoch=0, seed=1, replicas=1, batch_size=1, position={"x": 1})
    first = KEYS[0]
    with pytest.raises(ValueError, match="outside 0.."):
        plan_epoch(GROUPS, KEYS, epoch=0, seed=1, replicas=1, batch_size=1, position={first: 999})
