"""Stage 2 batch sources: the cache (split mode) or the raw data set (unsplit reference).

Both plan an epoch the same way (`batch_plan`): global batches within one group of
same-shaped samples (an aspect bucket), a position per group that survives a change of world
size or batch size, and a documented tail (`data.buckets.tail`). `UpdateBatches` hands the
training loop one update's micro-batches at a time and owns where the run stands in the data (the
epoch and the position within it: `state_dict()`, checkpointed).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitstage.config.job import SplitstageConfig
from splitstage.data.index import index_data_set
from splitstage.data.source import open_data_source
from splitstage.data.videos import is_video
from splitstage.pipelines.family import Family
from splitstage.pipelines.runtime import collate_samples
from splitstage.tasks.cache.reader import CacheDataset
from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.stage2.batch_plan import EpochPlan, Position, group_members, plan_epoch

Keyed = tuple[list[str], dict[str, Any]]  # a batch with its sample keys (they seed its draws)


class PlannedBatches:
    """What both sources share: the epoch plan over (sorted keys, group of each key)."""

    keys: Sequence[str]
    groups: np.ndarray
    stall_seconds: float = 0.0

    def __init__(self, config: SplitstageConfig, rank: int, world_size: int):
        self.config = config
        self.rank, self.world_size = rank, world_size
        self._plans: dict[tuple[int, str], EpochPlan] = {}

    @property
    def tail(self) -> str:
        """What a group's last partial global batch does: 'drop' or 'repeat'."""
        return self.config.data.buckets.tail

    def plan(self, epoch: int, position: Position | None = 0) -> EpochPlan:
        """The global batches left in `epoch` after `position` (memoized: all ranks agree)."""
        memo = (epoch, repr(position))
        if memo not in self._plans:
            if len(self._plans) >= 4:  # a few epochs' plans at a time (1M samples: ~1 s each)
                self._plans.pop(next(iter(self._plans)))
            self._plans[memo] = plan_epoch(
                self.groups,
                self.keys,
                epoch=epoch,
                seed=self.config.job.seed,
                replicas=self.world_size,
                batch_size=self.config.train.batch_size,
                position=position,
                tail=self.tail,
            )
        return self._plans[memo]

    def steps_per_epoch(self, position: Position | None = 0) -> int:
        """Batches per rank left in an epoch after `position` (the same on every rank and in
        every epoch: only group sizes count)."""
        return len(self.plan(0, position).batches)

    def position_after(self, epoch: int, position: Position | None, steps: int) -> Position:
        """The epoch position after `steps` batches per rank from `position`."""
        return self.plan(epoch, position).position_after(steps)

    def tail_cost(self) -> dict[str, int]:
        """Per epoch: samples no batch holds (drop) and samples held twice (repeat)."""
        plan = self.plan(0, 0)
        return {"groups": len(plan.group_names), "dropped": plan.dropped, "repeated": plan.repeated}

    def tail_line(self) -> str:
        """One line: the sample groups (aspect buckets) and what their tails cost per epoch."""
        groups, cost = self.group_labels(), self.tail_cost()
        shown = ", ".join(f"{label}: {n}" for label, n in list(groups.items())[:8])
        more = f", ... ({len(groups)} in all)" if len(groups) > 8 else ""
        return (
            f"buckets {shown}{more}; tail {self.tail}: {cost['dropped']} samples dropped and "
            f"{cost['repeated']} repeated per epoch"
        )

    def group_labels(self) -> dict[str, int]:
        """Samples per group, by a readable label."""
        raise NotImplementedError

    def rank_keys(self, epoch: int, position: Position | None) -> LazyBatches:
        """This rank's batches of sample keys for the rest of `epoch` (made as they are read)."""
        return LazyBatches(self.keys, self.plan(epoch, position), self.rank)


class LazyBatches(Sequence[list[str]]):
    """A rank's batches of sample keys, each built when indexed (no str per sample up front)."""

    def __init__(self, keys: Sequence[str], plan: EpochPlan, rank: int):
        self.keys, self.plan, self.rank = keys, plan, rank

    def __len__(self) -> int:
        return len(self.plan.batches)

    def __getitem__(self, step):
        if isinstance(step, slice):
            return [self[i] for i in range(*step.indices(len(self)))]
        return [self.keys[int(i)] for i in self.plan.rank_batch(step, self.rank)]


class CachedBatches(PlannedBatches):
    """Batches of boundary params read from the stage-1 cache with background prefetch."""

    def __init__(
        self,
        config: SplitstageConfig,
        store: CacheStore,
        rank: int,
        world_size: int,
        keys: list[str] | None = None,
    ):
        super().__init__(config, rank, world_size)
        if keys is None:  # the samples of the last whole preprocess run
            manifest = store.read_manifest()
            keys = manifest.get("samples") if manifest else None
        self.dataset = CacheDataset(store, keys)
        self.keys = self.dataset.keys
        self.groups = np.asarray(self.dataset.groups)

    @property
    def stall_seconds(self) -> float:
        """Seconds the training loop waited for the cache."""
        return self.dataset.stall_seconds

    def group_labels(self) -> dict[str, int]:
        """Samples per group, by the group's readable label (e.g. its latent shape)."""
        labels = self.dataset.group_labels
        return {labels[int(self.groups[m[0]])]: len(m) for m in group_members(self.groups)}

    def iterate(self, epoch: int, position: Position | None = 0) -> Iterator[Keyed]:
        """This rank's (sample keys, batch) pairs of `epoch` after `position`, prefetched."""
        return self.dataset.iterate_keys(
            self.rank_keys(epoch, position), prefetch=self.config.train.prefetch, with_keys=True
        )


class RawBatches(PlannedBatches):
    """Batches decoded from the data set every step: what training without a cache reads."""

    def __init__(self, family: Family, rank: int, world_size: int):
        config = family.config
        super().__init__(config, rank, world_size)
        self.family = family
        self.data_source = open_data_source(config.data)  # given to every load (no URL lookup)
        data = index_data_set(config)
        self.rows = dict(zip(data.keys, data.rows))
        self.keys = sorted(self.rows)
        # clips of other lengths side by side: image rows (one frame) beside video rows, and in
        # a video family animated images or videos known by content (their own frame counts)
        # and clips shortened to the frames they hold
        mixed = len({is_video(row.image) for row in data.rows}) > 1
        video = config.pipeline.takes_video()
        by_name = all(is_video(row.image) for row in data.rows)
        uneven = video and (not by_name or config.data.video.short_clips == "shorten")
        rule = family.reference_images  # references sized on their own differ in shape too
        own = rule is not None and rule.max_pixels is not None
        shaped = family.buckets or mixed or uneven or own
        self.groups = self._shape_groups() if shaped else np.zeros(len(self.keys), int)

    def _shape_groups(self) -> np.ndarray:
        """Group of each key by the decoded sample's size and frame count (as the cache groups
        by shape)."""
        base, sizes, out = self.data_source, {}, []
        for key in self.keys:
            sample = self.family.load_sample(self.rows[key], base)
            shape = (sample["height"], sample["width"], sample.get("num_frames", 1))
            refs = sample.get("reference_image", ())  # and its references' sizes
            refs = refs if isinstance(refs, list | tuple) else [refs]
            shape += tuple(tuple(ref.shape) for ref in refs)
            out.append(sizes.setdefault(shape, len(sizes)))
        return np.asarray(out, dtype=np.int64)

    def group_labels(self) -> dict[str, int]:
        """Samples per image size."""
        return {f"group {g}": int(n) for g, n in enumerate(np.bincount(self.groups))}

    def iterate(self, epoch: int, position: Position | None = 0) -> Iterator[Keyed]:
        """This rank's (sample keys, batch) pairs of `epoch` after `position`, in the cache's
        order."""
        base = self.data_source
        for keys in self.rank_keys(epoch, position):
            yield keys, collate_samples([self.family.load_sample(self.rows[k], base) for k in keys])


@dataclass
class Update:
    """One update's micro-batches (read as they are iterated) and the epoch they belong to."""

    epoch: int
    micro_batches: Iterator[Keyed]


class UpdateBatches:
    """A batch source cut into updates of `accumulation` micro-batches: `next_update()` gives
    the next one, moving to the next epoch when this one has no whole update left (its last
    `steps % accumulation` batches are not read). It owns the epoch and the position within it
    (samples consumed by all replicas): `state_dict()` / `load_state_dict()`."""

    def __init__(self, source: PlannedBatches, accumulation: int):
        self.source, self.accumulation = source, accumulation
        self.epoch = 0
        self.start: Position = 0  # the epoch's position when this process began reading it
        self.taken = 0  # micro-batches per rank read since `start`
        self._reading: Iterator[Keyed] | None = None  # the epoch's batches after `start`

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the position within it, plain numbers (or {group: count})."""
        return {"epoch": self.epoch, "offset": self.position()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's epoch and position."""
        self.close()
        offset = state["offset"]
        self.epoch = int(state["epoch"])
        self.start = dict(offset) if isinstance(offset, dict) else int(offset)
        self.taken = 0

    def position(self) -> Position:
        """Samples of this epoch consumed by all replicas (per group of sample shapes)."""
        if not self.taken:
            return self.start
        return self.source.position_after(self.epoch, self.start, self.taken)

    def updates_left(self) -> int:
        """Whole updates left in this epoch."""
        steps = self.source.steps_per_epoch(self.start) - self.taken
        return steps // self.accumulation

    def updates_per_epoch(self) -> int:
        """Whole updates in an epoch read from its start (the same in every epoch)."""
        return self.source.steps_per_epoch() // self.accumulation

    def planned_updates(self, done: int, epochs: int, max_steps: int | None) -> int:
        """The update a run ends at, `done` updates in and at this position: the rest of
        `epochs` epochs, capped at `max_steps`."""
        left = self.updates_left() if self.epoch < epochs else 0
        later = max(0, epochs - self.epoch - 1) * self.updates_per_epoch()
        total = done + left + later
        return min(total, max_steps) if max_steps else total

    def next_update(self) -> Update:
        """The next update's micro-batches, read (and prefetched) as they are iterated; the
        position moves past each micro-batch as it is handed out."""
        if self.updates_left() == 0:
            self._next_epoch()
        if self._reading is None:
            self._reading = iter(self.source.iterate(self.epoch, self.start))
        return Update(self.epoch, self._micro_batches())

    def _micro_batches(self) -> Iterator[Keyed]:
        assert self._reading is not None
        for _ in range(self.accumulation):
            keyed = next(self._reading)
            self.taken += 1
            yield keyed
        if self.updates_left() == 0:  # the epoch's last update: the next epoch's start is saved
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.close()
        self.epoch, self.start, self.taken = self.epoch + 1, 0, 0

    def close(self) -> None:
        """Stop reading (and prefetching) the current epoch; the next update reopens it at the
        position."""
        self.start, self.taken = self.position(), 0
        reading, self._reading = self._reading, None
        close = getattr(reading, "close", None)
        if close is not None:
            close()
