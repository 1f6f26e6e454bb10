"""The data-dependency graph of a unit sequence: most-recent-producer edges, updating chains."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitter.units import Unit


@dataclass(frozen=True)
class UnitGraph:
    """Per-unit inputs/outputs, producer->consumer edges with their param, and updating chains."""

    inputs: tuple[tuple[str, ...], ...]
    outputs: tuple[tuple[str, ...], ...]
    successors: tuple[tuple[tuple[int, str], ...], ...]
    chains: dict[str, tuple[int, ...]]
    chain_position: dict[str, dict[int, int]]


def build_graph(units: Sequence[Unit]) -> UnitGraph:
    """Build edges (Definition 1) and updating chains in one linear pass over the units."""
    inputs = tuple(unit.inputs for unit in units)
    outputs = tuple(unit.output_params for unit in units)
    successors: list[list[tuple[int, str]]] = [[] for _ in units]
    last_producer: dict[str, int] = {}
    chains: dict[str, list[int]] = {}
    chain_position: dict[str, dict[int, int]] = {}
    for index in range(len(units)):
        for param in inputs[index]:
            producer = last_producer.get(param)
            if producer is not None:
                successors[producer].append((index, param))
        for param in outputs[index]:
            last_producer[param] = index
            chain = chains.setdefault(param, [])
            # A unit listing a param twice appears twice in DiffSynth's chain; the first
            # occurrence is what `chain.index` finds, so only it is recorded.
            chain_position.setdefault(param, {}).setdefault(index, len(chain))
            chain.append(index)
    return UnitGraph(
        inputs=inputs,
        outputs=outputs,
        successors=tuple(tuple(s) for s in successors),
        chains={param: tuple(chain) for param, chain in chains.items()},
        chain_position=chain_position,
    )
