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

from splitter.graph import UnitGraph, build_graph
from splitter.units import Unit


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
    reasons: dict[int, Reason]
    graph: UnitGraph


def seed_units(units: Sequence[Unit], models: Iterable[str]) -> dict[int, Reason]:
    """X_0: units calling a trainable model, plus per-step units (the splitstage extension)."""
    models = tuple(models)
    reasons: dict[int, Reason] = {}
    for index, unit in enumerate(units):
        used = [m for m in models if m in unit.onload_model_names]
        if used:
            reasons[index] = Reason("model", model=used[0])
        elif unit.per_step:
            reasons[index] = Reason("per_step")
    return reasons


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
    reasons = seed_units(units, models)
    first_consumer: dict[str, int] = {}
    chain_done_from: dict[str, int] = {}  # chain[done_from:] already merged into V1
    pending = sorted(reasons)  # joined V1, outgoing edges not yet followed
    changed: set[str] = set()  # params whose first consumer moved since the last U step

    def consume(index: int) -> None:
        for param in graph.inputs[index]:
            if index < first_consumer.get(param, len(units)):
                first_consumer[param] = index
                changed.add(param)

    for index in pending:
        consume(index)
    while True:
        added = False
        # F: forward closure along producer -> consumer edges.
        while pending:
            source = pending.pop()
            for target, param in graph.successors[source]:
                if target not in reasons:
                    reasons[target] = Reason("reads", param=param, source=units[source].name)
                    consume(target)
                    pending.append(target)
                    added = True
        # U: for each param whose first consumer in V1 moved, merge the rest of its chain.
        joined: list[int] = []
        for param in sorted(changed):
            first = first_consumer[param]
            position = graph.chain_position.get(param, {}).get(first)
            if position is None:
                continue
            chain = graph.chains[param]
            stop = chain_done_from.get(param, len(chain))
            for later in chain[position + 1 : stop]:
                if later not in reasons:
                    reasons[later] = Reason("chain", param=param, source=units[first].name)
                    joined.append(later)
            chain_done_from[param] = min(stop, position + 1)
        changed.clear()
        for index in joined:
            consume(index)
        pending.extend(joined)
        if not joined and not added:
            break
    v1 = tuple(sorted(reasons))
    v2 = tuple(i for i in range(len(units)) if i not in reasons)
    return UnitSplit(v1=v1, v2=v2, reasons=reasons, graph=graph)
