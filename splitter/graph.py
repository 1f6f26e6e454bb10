"""The data-dependency graph of a unit sequence: most-recent-producer edges, updating chains."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from splitstage.splitter.units import Unit


@dataclass(frozen=True)
class UnitGraph:
    """Per-unit inputs/outputs, producer->consumer edges with their param, and updating chains."""

    inputs: list[tuple[str, ...]]
    outputs: list[Sequence[str]]  # each unit's output_params as declared: a bare str is its chars
    successors: list[list[tuple[int, str]]]  # per producer: (consumer, param); do not mutate
    chains: dict[str, list[int]]

    def chain_position(self, param: str, unit: int) -> int | None:
        """Where `unit` first appears in the updating chain of `param` (None if absent)."""
        chain = self.chains.get(param)
        if not chain:
            return None
        position = bisect_left(chain, unit)  # chains are in unit order
        return position if position < len(chain) and chain[position] == unit else None


def build_graph(units: Sequence[Unit]) -> UnitGraph:
    """Build edges (Definition 1) and updating chains in one linear pass over the units.

    Like DiffSynth-Studio's `fetch_*_params`, iterating a bare-string field yields its characters.
    """
    inputs = [unit.inputs for unit in units]
    outputs = [unit.output_params for unit in units]
    successors: list[list[tuple[int, str]]] = [[] for _ in units]
    last_producer: dict[str, int] = {}
    chains: dict[str, list[int]] = {}
    get_producer = last_producer.get
    get_chain = chains.get
    for index, reads in enumerate(inputs):
        for param in reads:
            producer = get_producer(param)
            if producer is not None:
                successors[producer].append((index, param))
        for param in outputs[index]:
            last_producer[param] = index
            # A unit listing a param twice appears twice, as in DiffSynth's chain; lookups use
            # the first occurrence, as its `chain.index` does.
            chain = get_chain(param)
            if chain is None:
                chains[param] = [index]
            else:
                chain.append(index)
    return UnitGraph(
        inputs=inputs,
        outputs=outputs,
        successors=successors,
        chains=chains,
    )
