"""Running units on a batch: a unit reads its declared params and writes exactly its outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from splitstage.pipelines.draws import Draws
from splitstage.splitter import Unit, UserError


class UnitRunError(UserError, RuntimeError):
    """A unit broke its declared contract (missing input, undeclared or missing output)."""


@dataclass
class StepContext:
    """What a unit needs besides its params: loaded models, device, per-step randomness (drawn
    per sample, see pipelines.draws)."""

    models: Mapping[str, torch.nn.Module]
    device: torch.device
    draws: Draws = field(default_factory=Draws.shared)
    settings: Mapping[str, Any] = field(default_factory=dict)

    def model(self, name: str, unit: str) -> torch.nn.Module:
        """The loaded model `name`, or an error saying the offload plan did not load it."""
        try:
            return self.models[name]
        except KeyError:
            loaded = ", ".join(sorted(self.models)) or "none"
            raise UnitRunError(
                f"unit '{unit}' needs model '{name}', which this stage did not load (loaded: "
                f"{loaded}); declare it in the unit's onload_model_names"
            ) from None


@dataclass(frozen=True)
class RunnableUnit:
    """A unit's declaration (what the splitter sees) plus the function that computes it."""

    spec: Unit
    process: Callable[..., dict[str, Any]]


def unit_kwargs(unit: Unit, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Gather a unit's arguments: `input_params` by name, posi dict argument -> param."""
    kwargs: dict[str, Any] = {}
    for param in unit.input_params:
        kwargs[param] = inputs.get(param)
    for argument, param in unit.input_params_posi.items():
        kwargs[argument] = inputs.get(param)
    return kwargs


def run_units(
    units: Sequence[RunnableUnit], ctx: StepContext, inputs: dict[str, Any]
) -> dict[str, Any]:
    """Run units in order, updating `inputs` in place with each unit's declared outputs."""
    for unit in units:
        outputs = unit.process(ctx, **unit_kwargs(unit.spec, inputs))
        declared = set(unit.spec.output_params)
        extra = sorted(set(outputs) - declared)
        missing = sorted(declared - set(outputs))
        if extra or missing:
            raise UnitRunError(
                f"unit '{unit.spec.name}' returned {sorted(outputs)} but declares output_params "
                f"{sorted(declared)} (undeclared: {extra}, missing: {missing}); fix the unit or "
                "its declaration, or the split will be wrong"
            )
        inputs.update(outputs)
    return inputs


def select(units: Iterable[RunnableUnit], names: Iterable[str]) -> list[RunnableUnit]:
    """The units called `names`, in pipeline order."""
    wanted = set(names)
    return [unit for unit in units if unit.spec.name in wanted]


def split_batch(
    batch: Mapping[str, Any],
    params: Iterable[str],
    size: int,
    sequences: Mapping[str, str | None] | None = None,
) -> list[dict[str, Any]]:
    """Per-sample records of `params`: tensors and lists are indexed on dim 0, scalars repeated;
    `sequences` (a family's `sequence_params`) cut to each sample's length (`trim_sequences`)."""
    samples: list[dict[str, Any]] = [{} for _ in range(size)]
    for param in params:
        if param not in batch:
            raise UnitRunError(
                f"boundary param '{param}' was not produced by stage 1 and is not a data field; "
                "add it to the data set or to a V2 unit's output_params"
            )
        value = batch[param]
        for index, sample in enumerate(samples):
            if isinstance(value, torch.Tensor):
                sample[param] = value[index].detach().to("cpu").clone()
            elif isinstance(value, list | tuple) and len(value) == size:
                sample[param] = value[index]
            else:
                sample[param] = value
    for sample in samples:
        trim_sequences(sample, sequences or {})
    return samples


def trim_sequences(sample: dict[str, Any], sequences: Mapping[str, str | None]) -> None:
    """A sample's masked sequence params (and their masks) cut after their last kept token
    (mask 1), in place: what stage 1 caches, so no sample stores another's padding."""
    for name, mask_name in sequences.items():
        mask = sample.get(mask_name) if mask_name else None
        if not isinstance(mask, torch.Tensor) or name not in sample:
            continue
        kept = mask.reshape(mask.shape[0], -1).ne(0).any(dim=1).nonzero()
        length = int(kept.max()) + 1 if len(kept) else 0
        sample[name] = sample[name][:length].clone()
        sample[mask_name] = mask[:length].clone()


def pad_sequences(
    samples: Sequence[dict[str, Any]], sequences: Mapping[str, str | None]
) -> list[dict[str, Any]]:
    """Copies of `samples` whose sequence params and masks are zero-padded (mask 0) at the end
    of dim 0 to one length, the longest of any of them in the batch, as diffusers' pipelines
    pad prompts per batch (one length, so a param and its `empty_` twin stay swappable)."""
    names = list(dict.fromkeys([*sequences, *filter(None, sequences.values())]))
    tensors = [s[n] for s in samples for n in names if isinstance(s.get(n), torch.Tensor)]
    if not tensors:
        return list(samples)
    length = max(t.shape[0] for t in tensors)
    out = []
    for sample in samples:
        padded = dict(sample)
        for name in names:
            value = sample.get(name)
            if isinstance(value, torch.Tensor) and value.shape[0] < length:
                tail = value.new_zeros(length - value.shape[0], *value.shape[1:])
                padded[name] = torch.cat([value, tail])
        out.append(padded)
    return out


def collate_samples(
    samples: Sequence[dict[str, Any]], sequences: Mapping[str, str | None] | None = None
) -> dict[str, Any]:
    """Stack image tensors (`sequences` padded to the batch's longest first: `pad_sequences`);
    keep every other field as a per-sample list."""
    samples = pad_sequences(samples, sequences) if sequences else samples
    batch: dict[str, Any] = {}
    for name in samples[0]:
        values = [sample[name] for sample in samples]
        batch[name] = torch.stack(values) if isinstance(values[0], torch.Tensor) else values
    return batch
