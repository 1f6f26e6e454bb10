"""DiffSynth units on the seam: each runs through DiffSynth's own `pipe.unit_runner`, per sample.

splitstage's runtime hands a unit its declared params (flat, per batch) and keeps exactly its
declared outputs. DiffSynth's runner works on three dicts per sample (shared / posi / nega) and
lets units take over all three or return nothing for absent inputs. A `Session` keeps those three
dicts per sample across the units of one pass (V2 in stage 1, V1 in stage 2), seeded with the
training inputs DiffSynth's train.py sets and with every param the runtime hands in; each unit's
declared outputs are read back from the session (an output a unit did not write keeps its value).

Values cross into the flat batch as one entry per sample (`split_batch` indexes lists), encoded
for our cache: a list of tensors (Z-Image's `prompt_embeds`) becomes one stacked tensor, which
`decode` turns back into a list for the params in `TENSOR_LISTS`; plain values stay JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from splitstage.pipelines.runtime import RunnableUnit, StepContext, UnitRunError
from splitstage.splitter import Unit

# Params a pipeline produces as a list of per-image tensors (cached stacked, decoded to a list).
TENSOR_LISTS = {
    "ZImagePipeline": frozenset({"prompt_embeds", "image_embeds", "image_latents"}),
    "WanVideoPipeline": frozenset(),
    # edit_latents: one tensor per reference image; model_fn reads one tensor as a list of one
    "QwenImagePipeline": frozenset({"edit_latents"}),
}


# Inputs DiffSynth's train.py sets to the pipeline's device (`"rand_device": self.pipe.device`)
# unless the row gives them: the noise of a row without `rand_device` is drawn where it runs.
ON_PIPE_DEVICE = ("rand_device",)


@dataclass
class Triple:
    """DiffSynth's inputs of one sample: shared, posi and nega dicts; `defaults`: the shared
    names still holding train.py's fixed values, which the data's values replace (as
    DiffSynth's `parse_extra_inputs` puts the row's extra inputs over them)."""

    shared: dict[str, Any]
    posi: dict[str, Any] = field(default_factory=dict)
    nega: dict[str, Any] = field(default_factory=dict)
    defaults: set[str] = field(default_factory=set)

    def get(self, name: str) -> Any:
        """A param as DiffSynth's losses see it: posi over shared (`**shared, **posi`)."""
        return self.posi[name] if name in self.posi else self.shared.get(name)

    def has(self, name: str) -> bool:
        """Whether some unit (or the data) set `name`."""
        return name in self.posi or name in self.shared


class Session:
    """The per-sample triples of one pass over a pipeline's units."""

    def __init__(self, constants: Mapping[str, Any]):
        self.constants = dict(constants)
        self.triples: list[Triple] = []
        self.last_index = -1
        self.ctx: StepContext | None = None  # the step the triples belong to

    def begin(self, ctx: StepContext, index: int, count: int) -> list[Triple]:
        """The triples for unit `index`; a new step, or a unit at or before the last one,
        starts a new pass."""
        fresh = ctx is not self.ctx or index <= self.last_index or len(self.triples) != count
        if fresh:
            self.triples = [
                Triple(dict(self.constants), defaults=set(self.constants)) for _ in range(count)
            ]
        self.ctx, self.last_index = ctx, index
        return self.triples

    def of(self, ctx: StepContext, count: int) -> list[Triple] | None:
        """The triples this step's units left (None when no unit ran in this step)."""
        return self.triples if ctx is self.ctx and len(self.triples) == count else None


def batch_size(values: Mapping[str, Any]) -> int:
    """Samples in a flat batch: the length of its per-sample lists / first dims (1 if none)."""
    for value in values.values():
        if isinstance(value, torch.Tensor) and value.ndim:
            return value.shape[0]
        if isinstance(value, list):
            return len(value)
    return 1


def pick(value: Any, index: int, count: int) -> Any:
    """Sample `index` of a flat batch value (tensors and lists by position, others as they are)."""
    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == count:
        return value[index]
    if isinstance(value, list | tuple) and len(value) == count:
        return value[index]
    return value


def decode(name: str, value: Any, lists: frozenset[str]) -> Any:
    """A cached per-sample value as DiffSynth made it: batch dim back, lists of tensors back."""
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0)) if name in lists else value.unsqueeze(0)
    return value


def encode(name: str, value: Any, unit: str, lists: frozenset[str]) -> Any:
    """One sample's DiffSynth value in our batch form (tensors lose their batch dim of 1; a
    list param written as one tensor is cached as a list of it)."""
    if name in lists and isinstance(value, torch.Tensor):
        value = [value]
    if isinstance(value, torch.Tensor):
        if value.ndim == 0 or value.shape[0] != 1:
            raise UnitRunError(
                f"unit '{unit}' wrote '{name}' with shape {tuple(value.shape)}: splitstage caches "
                "DiffSynth tensors of one sample (first dimension 1)"
            )
        return value[0]
    if isinstance(value, list | tuple) and value and all(torch.is_tensor(v) for v in value):
        if name not in lists:
            raise UnitRunError(
                f"unit '{unit}' wrote '{name}' as a list of tensors, which this pipeline's "
                "cache layout does not know; add it to units.TENSOR_LISTS"
            )
        return torch.stack(list(value))
    if holds_tensor(value):  # e.g. lists of lists (Z-Image Omni-Base's prompt segments)
        raise UnitRunError(
            f"unit '{unit}' wrote '{name}' as tensors nested in lists or dicts, which splitstage's "
            "cache does not store (a tensor, a list of one sample's tensors, or JSON values); "
            "this model variant is not supported by the diffsynth family yet"
        )
    return value


def holds_tensor(value: Any) -> bool:
    """Whether a list / tuple / dict holds a tensor at any depth."""
    if isinstance(value, list | tuple):
        return any(torch.is_tensor(v) or holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(torch.is_tensor(v) or holds_tensor(v) for v in value.values())
    return False


class DiffSynthUnits:
    """The seam's units for one DiffSynth pipeline object (its `.units`, in order)."""

    def __init__(
        self,
        units: Sequence[Any],
        specs: Sequence[Unit],
        constants: Mapping[str, Any],
        loaded: Callable[[], Any],
        pipeline_class: str,
    ):
        self.units = list(units)
        self.specs = list(specs)
        self.session = Session(constants)
        self.loaded = loaded  # the pipeline with its models, loaded on first use
        self.lists = TENSOR_LISTS.get(pipeline_class, frozenset())

    def runnable(self) -> list[RunnableUnit]:
        """One RunnableUnit per DiffSynth unit, its declaration as the splitter reads it."""
        return [
            RunnableUnit(spec, self._process(index, unit, spec))
            for index, (unit, spec) in enumerate(zip(self.units, self.specs))
        ]

    def seed(
        self, triple: Triple, unit: Any, values: Mapping[str, Any], device: Any = None
    ) -> None:
        """Put the params the runtime handed in (data or earlier passes) into a triple: over
        train.py's fixed values, never over what a unit of this pass wrote; an input train.py
        sets to the pipeline's device gets `device` when nothing gave it."""
        posi = dict(getattr(unit, "input_params_posi", None) or {})
        for argument, value in values.items():
            if argument in posi:
                name = posi[argument]
                if not triple.has(name):
                    triple.posi[name] = decode(name, value, self.lists)
            elif not triple.has(argument) or argument in triple.defaults:
                if value is None and argument in triple.shared:
                    continue  # nothing given: train.py's value stays
                triple.shared[argument] = decode(argument, value, self.lists)
                triple.defaults.discard(argument)
        for name in ON_PIPE_DEVICE:
            if name in triple.shared and triple.shared[name] is None and device is not None:
                triple.shared[name] = device

    def _process(self, index: int, unit: Any, spec: Unit):
        def process(ctx: StepContext, **values: Any) -> dict[str, Any]:
            count = batch_size(values) if values else len(self.session.triples) or 1
            triples = self.session.begin(ctx, index, count)
            outputs: dict[str, list[Any]] = {name: [] for name in spec.output_params}
            pipe = self.loaded()
            for i, triple in enumerate(triples):
                given = {k: pick(v, i, count) for k, v in values.items()}
                self.seed(triple, unit, given, getattr(pipe, "device", None))
                before = {n: triple.shared.get(n) for n in triple.defaults}
                shared, posi, nega = pipe.unit_runner(
                    unit, pipe, triple.shared, triple.posi, triple.nega
                )
                triple.shared, triple.posi, triple.nega = shared, posi, nega
                # a name the unit wrote (in place or in a new dict) is the unit's now
                triple.defaults = {n for n, v in before.items() if shared.get(n) is v}
                for name in outputs:
                    value = triple.get(name)
                    outputs[name].append(encode(name, value, spec.name, self.lists))
            return outputs

        return process


def loss_inputs(
    session: Session, ctx: StepContext, inputs: Mapping[str, Any], lists: frozenset[str]
) -> list[dict[str, Any]]:
    """Per sample, what DiffSynth's loss gets (`**shared, **posi`): the batch's params decoded,
    under the session's (V1 units' writes), over train.py's fixed values, without the params no
    unit set (None)."""
    count = batch_size(inputs)
    triples = session.of(ctx, count)
    samples = []
    for i in range(count):
        values = {k: decode(k, pick(v, i, count), lists) for k, v in inputs.items()}
        if triples is not None:  # the units' writes over the batch, train.py's values under it
            triple = triples[i]
            shared = {k: v for k, v in triple.shared.items() if k not in triple.defaults}
            values = {**values, **shared, **triple.posi}
        values = {**session.constants, **values}
        samples.append({k: v for k, v in values.items() if v is not None})
    return samples
