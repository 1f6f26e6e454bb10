"""Direct distillation's row table: the teacher's settings each row carries, read and checked once.

DiffSynth's metadata columns: `seed` and `num_inference_steps` (required), `rand_device` and
`cfg_scale` (optional). Every family that trains `train.task = "direct_distill"` reads a row
through `distill_values`, and `check_distill_rows` runs it over the whole table before stage 1
loads a model (validate, preprocess and train alike), so a bad value is one line naming the row
and the column, never a truncated seed or a traceback in a worker.

A row without `rand_device` draws its starting noise on the device stage 1 runs on, as
DiffSynth's train.py passes `rand_device = pipe.device`: its noise then depends on that device
(a seed gives other noise on a GPU than on a CPU); give the column to pin it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from splitstage.config.job import ConfigError
from splitstage.data.dataset import Row

if TYPE_CHECKING:
    from splitstage.config.job import SplitstageConfig

COLUMNS = ("seed", "num_inference_steps")  # required
OPTIONAL = ("rand_device", "cfg_scale")
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
STEPS_MAX = 1000  # a sampling loop longer than the training schedule's steps is a typo
SHOWN = 5  # rows named in one refusal


def _integer(row: Row, column: str, low: int, high: int) -> int:
    """The row's `column` as an exact integer in [low, high] (7.9, true, "7.5" refused)."""
    value = row.extras.get(column)
    number: Any = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = None
    if isinstance(number, float) and math.isfinite(number) and number.is_integer():
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int):
        raise ConfigError(
            f"{row.where}: {column} = {value!r} is not a whole number; direct distillation "
            f"needs the teacher's integer {column} in each row"
        )
    if not low <= number <= high:
        raise ConfigError(f"{row.where}: {column} = {number} is outside {low} ... {high}")
    return number


def _scale(row: Row) -> float | None:
    """The row's `cfg_scale` as a finite number, or None when the row gives none."""
    value = row.extras.get("cfg_scale")
    if value is None or value == "":
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        scale = float(value)
    except (TypeError, ValueError):
        scale = math.nan
    if not math.isfinite(scale) or scale < 0:
        raise ConfigError(
            f"{row.where}: cfg_scale = {value!r} is not a number >= 0 (the teacher's guidance "
            "scale); leave it empty for the pipeline's default"
        )
    return scale


def _device(row: Row) -> str | None:
    """The row's `rand_device`: a device this machine has, or None (the stage-1 device)."""
    value = row.extras.get("rand_device")
    if value is None or value == "":
        return None
    try:
        device = torch.device(str(value).strip())
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"{row.where}: rand_device = {value!r} is not a device torch draws noise on; "
            "use 'cpu' or 'cuda' (or leave it empty: the device stage 1 runs on)"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{row.where}: rand_device = {value!r} but CUDA is not available on this machine; "
            "use 'cpu' (other noise than CUDA's for the same seed) or run on a GPU"
        )
    return str(device)


def distill_values(row: Row) -> dict[str, Any]:
    """The row's teacher settings, checked: seed, steps, rand_device (None: the stage-1
    device) and cfg_scale (None: the pipeline's default)."""
    missing = [c for c in COLUMNS if row.extras.get(c) is None or row.extras.get(c) == ""]
    if missing:
        raise ConfigError(
            f"{row.where}: train.task = 'direct_distill' needs the column(s) "
            f"{', '.join(missing)} (the teacher's seed and steps); add them to the metadata"
        )
    return {
        "seed": _integer(row, "seed", SEED_MIN, SEED_MAX),
        "num_inference_steps": _integer(row, "num_inference_steps", 1, STEPS_MAX),
        "rand_device": _device(row),
        "cfg_scale": _scale(row),
    }


def check_distill_rows(rows: Iterable[Row]) -> None:
    """Every row's teacher settings, before stage 1 loads a model: ConfigError naming the
    first rows that fail (one line each, at most SHOWN) and how many fail in all."""
    problems: list[str] = []
    count = 0
    for row in rows:
        try:
            distill_values(row)
        except ConfigError as error:
            count += 1
            if len(problems) < SHOWN:
                problems.append(str(error))
    if count:
        more = f" (and {count - len(problems)} more rows)" if count > len(problems) else ""
        raise ConfigError("; ".join(problems) + more)


def check_rows(config: SplitstageConfig, rows: Iterable[Row]) -> None:
    """The row table's values the job's task reads, before stage 1 loads a model (preprocess,
    validate and train alike): reference images against the family's rule, video rows
    against the media it trains on, and direct distillation's teacher settings."""
    from splitstage.pipelines.family import check_family_rows
    from splitstage.pipelines.video_rows import check_video_rows

    check_family_rows(config, rows)
    check_video_rows(config, rows)  # video files for a family that trains on images
    if config.train.task == "direct_distill":
        check_distill_rows(rows)
