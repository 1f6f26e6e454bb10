"""The V1/V2 split: DiffSynth-Studio's fixed point of forward and updating-chain closure, fast.

The seed pseudocode recomputes every closure from scratch each round (quadratic or worse). This
version replays the same rounds incrementally: a unit is expanded once when it joins V1, and a
param's updating chain is revisited only when its first consumer inside V1 moves earlier. The
result equals the seed's on every graph, including where its `updating_units` is not monotone
(a first consumer that only reads a param adds nothing), which the property tests check.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

from splitstage.splitter.graph import UnitGraph, build_graph
from splitstage.splitter.units import Unit


@dataclass(frozen=True)
class Reason:
    """Why a unit is in V1: the first rule that put it there."""

    kind: str  # "model" | "per_step" | "reads" | "chain"
    model: str | None = None
    param: str | None = None
    source: str | None = None

    def text(self) -> str:
        """A sentence a person can follow back toward a trainable model."""
        if self.kind == "model":
            return f"uses trainable model '{self.model}'"
        if self.kind == "per_step":
            return "per-step unit: its result must be fresh every step, so it is never cached"
        if self.kind == "reads":
            return f"reads '{self.param}' produced by V1 unit '{self.source}'"
        return (
            f"updating chain of '{self.param}': rewrites it after V1 unit '{self.source}' "
            "first reads it"
        )


@dataclass(frozen=True)
class UnitSplit:
    """Unit indices of V1 and V2 in pipeline order, and the reason for each V1 unit."""

    v1: tuple[int, ...]
    v2: tuple[int, ...]
    why: dict[int, tuple]  # unit -> (kind, detail, source unit index); Reasons built on demand
    graph: UnitGraph
    units: Sequence[Unit]

    @cached_property
    def reasons(self) -> dict[int, Reason]:
        """The Reason of every V1 unit."""
        out = {}
        for index, (kind, detail, source) in self.why.items():
            if kind == "model":
                out[index] = Reason("model", model=detail)
            elif kind == "per_step":
                out[index] = Reason("per_step")
            else:
                out[index] = Reason(kind, param=detail, source=self.units[source].name)
        return out


def seed_units(units: Sequence[Unit], models: Iterable[str]) -> dict[int, tuple]:
    """X_0: units calling a trainable model, plus per-step units (the splitstage extension).

    The test is DiffSynth-Studio's `model in onload_model_names`: a substring test on a bare string.
    """
    models = tuple(models)
    why: dict[int, tuple] = {}
    for index, unit in enumerate(units):
        if unit.onload_model_names:
            used = [m for m in models if m in unit.onload_model_names]
            if used:
                why[index] = ("model", used[0], None)
                continue
        if unit.per_step:
            why[index] = ("per_step", None, None)
    return why


@contextmanager
def _no_gc():
    """Pause the cyclic GC: the split allocates many small acyclic objects, and collections
    scanning a large heap mid-split would make its time grow faster than linearly."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def split_units(units: Sequence[Unit], models: Iterable[str]) -> UnitSplit:
    """Split units into (V1, V2) exactly as DiffSynth-Studio's `split_pipeline_units` does."""
    with _no_gc():
        return _split_units(units, tuple(models))


def _split_units(units: Sequence[Unit], models: tuple[str, ...]) -> UnitSplit:
    graph = build_graph(units)
    inputs, successors = graph.inputs, graph.successors
    why = seed_units(units, models)
    never = len(units)
    first_consumer: dict[str, int] = {}
    chain_done_from: dict[str, int] = {}  # chain[done_from:] already merged into V1
    changed: set[str] = set()  # params whose first consumer moved since the last U step

    def consume(indices) -> None:
        get = first_consumer.get
        for index in indices:
            for param in inputs[index]:
                if index < get(param, never):
                    first_consumer[param] = index
                    changed.add(param)

    pending = sorted(why)  # joined V1, outgoing edges not yet followed
    consume(pending)
    while True:
        added = False
        # F: forward closure along producer -> consumer edges (consume inlined: hot loop).
        get = first_consumer.get
        while pending:
            source = pending.pop()
            for target, param in successors[source]:
                if target not in why:
                    why[target] = ("reads", param, source)
                    for read in inputs[target]:
                        if target < get(read, never):
                            first_consumer[read] = target
                            changed.add(read)
                    pending.append(target)
                    added = True
        # U: for each param whose first consumer in V1 moved, merge the rest of its chain.
        joined: list[int] = []
        for param in sorted(changed):
            first = first_consumer[param]
            position = graph.chain_position(param, first)
            if position is None:
                continue
            chain = graph.chains[param]
            stop = chain_done_from.get(param, len(chain))
            for later in chain[position + 1 : stop]:
                if later not in why:
                    why[later] = ("chain", param, first)
                    joined.append(later)
            chain_done_from[param] = min(stop, position + 1)
        changed.clear()
        consume(joined)
        pending.extend(joined)
        if not joined and not added:
            break
    v1 = tuple(sorted(why))
    v2 = tuple([i for i in range(len(units)) if i not in why])
    return UnitSplit(v1=v1, v2=v2, why=why, graph=graph, units=units)
