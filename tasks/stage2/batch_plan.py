"""One epoch's global batches, each from one group of same-shaped samples (an aspect bucket).

Every group's samples (by index into the sorted sample keys) are shuffled with (seed, epoch,
the group's first key); the samples an interrupted run already consumed (`position`: how many of
each group's order) are skipped; the rest are cut into global batches of batch_size x replicas,
and the batches of all groups are interleaved in a seeded order. Rank r takes every
replicas-th sample of a global batch from r. A group's last partial global batch is dropped
(`tail="drop"`: different samples each epoch, the count is `dropped`) or filled with that group's
first samples of the epoch (`tail="repeat"`).

The position is per group, so a resume with another world size or batch size continues exactly:
each sample of the epoch is seen once. With one group it is a plain sample count and the order
is the one `reader.epoch_order` gives.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

Position = int | dict[str, int]  # samples consumed: a count (one group) or {group name: count}


@dataclass
class EpochPlan:
    """The global batches left in one epoch after `position`, for `replicas` ranks."""

    batches: list[tuple[int, np.ndarray]]  # (group, sample indices of the global batch)
    group_names: list[str]  # a stable name per group: its first sample key
    start: dict[int, int]  # consumed samples per group when the plan starts
    replicas: int
    dropped: int = 0  # samples of this epoch no batch holds (tail="drop")
    repeated: int = 0  # samples a batch holds a second time (tail="repeat")
    sizes: dict[int, int] = field(default_factory=dict)  # samples per group
    _turns: np.ndarray | None = field(default=None, repr=False)
    _lengths: np.ndarray | None = field(default=None, repr=False)

    def rank_batch(self, step: int, rank: int) -> np.ndarray:
        """Rank `rank`'s sample indices of global batch `step`."""
        return self.batches[step][1][rank :: self.replicas]

    def position_after(self, steps: int) -> Position:
        """The position after the first `steps` global batches of this plan."""
        if self._turns is None:  # group and length of every batch, for vectorized sums
            self._turns = np.array([g for g, _ in self.batches], dtype=np.int64)
            self._lengths = np.array([len(b) for _, b in self.batches], dtype=np.int64)
        taken = np.bincount(
            self._turns[:steps], weights=self._lengths[:steps], minlength=len(self.group_names)
        )
        consumed = dict(self.start)
        for group in np.flatnonzero(taken):
            group = int(group)
            consumed[group] = min(self.sizes[group], consumed.get(group, 0) + int(taken[group]))
        if len(self.group_names) == 1:
            return consumed.get(0, 0)
        return {self.group_names[g]: n for g, n in sorted(consumed.items()) if n}


def group_members(groups: Sequence[int] | np.ndarray) -> list[np.ndarray]:
    """Sample indices of each group, ascending (groups numbered 0..G-1 in any order)."""
    groups = np.asarray(groups, dtype=np.int64)
    if groups.size == 0:
        return []
    order = np.argsort(groups, kind="stable")
    cuts = np.flatnonzero(np.diff(groups[order])) + 1
    members = np.split(order, cuts)
    return sorted(members, key=lambda m: int(m[0]))  # by first (smallest-key) sample


def plan_epoch(
    groups: Sequence[int] | np.ndarray,
    keys: Sequence[str],
    *,
    epoch: int,
    seed: int,
    replicas: int,
    batch_size: int,
    position: Position | None = 0,
    tail: str = "drop",
) -> EpochPlan:
    """The epoch's remaining global batches (see the module docstring)."""
    if replicas < 1 or batch_size < 1:
        raise ValueError(f"need replicas >= 1 and batch_size >= 1, got {replicas}, {batch_size}")
    if tail not in ("drop", "repeat"):
        raise ValueError(f"tail must be 'drop' or 'repeat', got {tail!r}")
    members = group_members(groups)
    names = [keys[int(m[0])] for m in members]
    start = _start(position, names, [len(m) for m in members])
    width = batch_size * replicas
    plan = EpochPlan([], names, start, replicas, sizes={g: len(m) for g, m in enumerate(members)})
    chunks: list[list[np.ndarray]] = []
    for g, indices in enumerate(members):
        salt = "" if len(members) == 1 else f":{names[g]}"
        order = list(range(len(indices)))
        random.Random(f"splitstage-epoch:{seed}:{epoch}{salt}").shuffle(order)
        shuffled = indices[np.asarray(order, dtype=np.int64)]
        rest = shuffled[start.get(g, 0) :]
        full = len(rest) // width
        group_chunks = [rest[i * width : (i + 1) * width] for i in range(full)]
        left = rest[full * width :]
        if len(left) and tail == "repeat":
            fill = np.resize(shuffled, width - len(left))  # the epoch's first samples, cycled
            group_chunks.append(np.concatenate([left, fill]))
            plan.repeated += len(fill)
        else:
            plan.dropped += len(left)
        chunks.append(group_chunks)
    turns = [g for g, group_chunks in enumerate(chunks) for _ in group_chunks]
    if len(chunks) > 1:
        random.Random(f"splitstage-steps:{seed}:{epoch}:{_digest(start)}").shuffle(turns)
    taken = [0] * len(chunks)
    for g in turns:
        plan.batches.append((g, chunks[g][taken[g]]))
        taken[g] += 1
    return plan


def _start(position: Position | None, names: list[str], sizes: list[int]) -> dict[int, int]:
    """Consumed samples per group index from a saved position; ValueError if it does not fit."""
    if not position:
        return {}
    if isinstance(position, int):
        if len(names) != 1:
            raise ValueError(
                f"position {position} is a plain sample count but the cache holds {len(names)} "
                "groups of sample shapes"
            )
        return {0: _checked(position, sizes[0], names[0])}
    if not isinstance(position, Mapping):
        raise ValueError(f"position must be a count or {{group: count}}, got {position!r}")
    index = {name: g for g, name in enumerate(names)}
    unknown = sorted(set(position) - set(index))
    if unknown:
        raise ValueError(f"position names groups the cache does not have: {unknown[:3]}")
    return {index[n]: _checked(c, sizes[index[n]], n) for n, c in position.items()}


def _checked(count: int, size: int, name: str) -> int:
    if not isinstance(count, int) or not 0 <= count <= size:
        raise ValueError(f"position {count!r} of group {name[:12]} is outside 0..{size}")
    return count


def _digest(start: Mapping[int, int]) -> str:
    text = json.dumps(sorted(start.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
