"""The values of `train.optimizer_args` and `train.lr_scheduler_args`, checked when the config
loads (torch-free, so `validate`, `preprocess` and `train` all refuse them before any model
loads): each argument an optimizer documents in the range and type it documents, and each
schedule argument only with a schedule that takes it.

Argument names an optimizer does not take are refused by `tasks.stage2.optimization`
(`check_update_rule`, which reads the installed optimizer's signature).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

Rule = Callable[[Any], str | None]  # the problem with a value, in words, or None


def _is_number(value: Any) -> bool:
    """A finite int or float (TOML's bools are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def number(
    low: float | None = None,
    high: float | None = None,
    *,
    open_low: bool = False,
    open_high: bool = True,
) -> Rule:
    """A number in [low, high) (or the bounds `open_low` / `open_high` say)."""
    left, right = "(" if open_low else "[", ")" if open_high else "]"
    span = f"in {left}{'-inf' if low is None else low}, {'inf' if high is None else high}{right}"

    def rule(value: Any) -> str | None:
        if not _is_number(value):
            return f"must be a number {span}"
        too_low = low is not None and (value <= low if open_low else value < low)
        too_high = high is not None and (value >= high if open_high else value > high)
        return f"must be {span}" if too_low or too_high else None

    return rule


def integer(low: int, choices: tuple[int, ...] = ()) -> Rule:
    """A whole number >= low (one of `choices` when given)."""

    def rule(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be a whole number {f'in {list(choices)}' if choices else f'>= {low}'}"
        if choices and value not in choices:
            return f"must be one of {list(choices)}"
        return f"must be >= {low}" if value < low else None

    return rule


def pair(each: Rule, what: str) -> Rule:
    """A list of exactly two values, each passing `each`; `what` says the list's shape."""

    def rule(value: Any) -> str | None:
        good = isinstance(value, list) and len(value) == 2 and not any(map(each, value))
        return None if good else f"must be {what}"

    return rule


def flag(value: Any) -> str | None:
    """A rule: true or false."""
    return None if isinstance(value, bool) else "must be true or false"


def refused(why: str) -> Rule:
    """A rule refusing `true` (an option splitstage cannot honour), with why."""
    return lambda value: why if value is not False else None


UNIT = number(0, 1)  # betas and averaging coefficients: [0, 1)
POSITIVE = number(0, None, open_low=True)
BETAS = pair(UNIT, "two numbers [beta1, beta2], each in [0, 1)")
ADAMW = {
    "betas": BETAS,
    "eps": POSITIVE,
    "amsgrad": flag,
    "maximize": flag,
    "foreach": flag,
    "capturable": flag,
    "differentiable": flag,
    "fused": flag,
}
# name -> {argument: rule}: the ranges and types each optimizer's documentation gives
OPTIMIZER_RULES: dict[str, dict[str, Rule]] = {
    "adamw": ADAMW,
    "adamw8bit": {
        "betas": BETAS,
        "eps": POSITIVE,
        "amsgrad": flag,
        "optim_bits": integer(8, (8, 32)),
        "min_8bit_size": integer(0),
        "percentile_clipping": integer(1),
        "block_wise": flag,
        "is_paged": flag,
    },
    "prodigy": {
        "betas": BETAS,
        "beta3": UNIT,
        "eps": POSITIVE,
        "d0": POSITIVE,
        "d_coef": POSITIVE,
        "growth_rate": number(1, math.inf, open_high=False),
        "decouple": flag,
        "use_bias_correction": flag,
        "safeguard_warmup": flag,
        "fsdp_in_use": flag,
        "slice_p": integer(1),
    },
    "adafactor": {
        "eps": pair(POSITIVE, "two numbers > 0 [eps1 (squared gradient), eps2 (parameter scale)]"),
        "clip_threshold": POSITIVE,
        "decay_rate": number(None, 0),
        "beta1": UNIT,
        "scale_parameter": flag,
        "relative_step": refused(
            "cannot be true: Adafactor's relative step computes its own learning rate, and "
            "splitstage gives it train.learning_rate; remove relative_step (and warmup_init)"
        ),
        "warmup_init": refused(
            "cannot be true: it needs relative_step, which splitstage leaves off (it gives "
            "Adafactor train.learning_rate); remove warmup_init"
        ),
    },
}
# schedule argument -> (the schedules of diffusers' get_scheduler that take it, its rule)
SCHEDULE_RULES: dict[str, tuple[tuple[str, ...], Rule]] = {
    "num_cycles": (("cosine_with_restarts",), integer(1)),
    "power": (("polynomial",), POSITIVE),
}
SCHEDULE_ARGUMENTS = tuple(SCHEDULE_RULES)


def optimizer_args_problem(optimizer: str, arguments: Mapping[str, Any]) -> str | None:
    """The first argument of `arguments` outside what `optimizer` documents, in one line."""
    rules = OPTIMIZER_RULES.get(optimizer, {})
    for name, value in arguments.items():
        rule = rules.get(name)
        problem = rule(value) if rule is not None else None
        if problem:
            documented = f" (as {optimizer} documents it)" if problem.startswith("must") else ""
            return f"{name} = {_toml(value)}: {problem}{documented}"
    return None


def _toml(value: Any) -> str:
    """A value as the TOML file spells it (true, "text", [0.9, 0.99])."""
    return json.dumps(value)


def schedule_args_problem(schedule: str, arguments: Mapping[str, Any]) -> str | None:
    """The first argument of `arguments` that `schedule` does not take, or of a wrong type."""
    for name, value in arguments.items():
        if name not in SCHEDULE_RULES:
            return (
                f"{name} is not a schedule argument; use {' or '.join(SCHEDULE_ARGUMENTS)} "
                "(with the schedule that takes it)"
            )
        takers, rule = SCHEDULE_RULES[name]
        if schedule not in takers:
            return (
                f"{name} is taken by the {' and '.join(takers)} schedule, not by "
                f"train.lr_scheduler = {schedule!r} (it would be ignored); remove it, or set "
                f"train.lr_scheduler = {takers[0]!r}"
            )
        problem = rule(value)
        if problem:
            return f"{name} = {_toml(value)}: {problem}"
    return None


def checked_optimizer_args(cls: type, value: dict[str, Any], info: Any) -> dict[str, Any]:
    """A config validator of `train.optimizer_args` against `train.optimizer`'s ranges."""
    optimizer = info.data.get("optimizer")
    problem = optimizer_args_problem(optimizer, value) if optimizer else None
    if problem:
        raise ValueError(problem)
    return value


def checked_schedule_args(cls: type, value: dict[str, Any], info: Any) -> dict[str, Any]:
    """A config validator of `train.lr_scheduler_args` against `train.lr_scheduler`."""
    schedule = info.data.get("lr_scheduler")
    problem = schedule_args_problem(schedule, value) if schedule else None
    if problem:
        raise ValueError(problem)
    return value
