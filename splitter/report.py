"""Human-readable views of a split plan: a terminal table and rows for dashboards."""

from __future__ import annotations

from splitstage.splitter.plan import SplitPlan


def plan_rows(plan: SplitPlan) -> list[dict]:
    """One row per unit (unit, stage, reason, models) in pipeline order, for tables/artifacts."""
    stage_of = {name: "V1 (stage 2, every step)" for name in plan.v1}
    stage_of.update({name: "V2 (stage 1, cached)" for name in plan.v2})
    order = [*plan.v1, *plan.v2]
    order.sort(key=lambda name: plan.unit_order.get(name, 0))
    return [
        {
            "unit": name,
            "stage": stage_of[name],
            "reason": plan.reasons.get(name, "needs no trainable model: computed once"),
            "models": ", ".join(plan.unit_models.get(name, ())),
        }
        for name in order
    ]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(out)


def plan_table(plan: SplitPlan) -> str:
    """The `splitstage plan --format table` text."""
    rows = plan_rows(plan)
    trainable = ", ".join(plan.trainable) or "(none: everything is cached)"
    parts = [
        f"pipeline {plan.pipeline}; trainable: {trainable}",
        "",
        _table(
            ["unit", "stage", "models", "reason"],
            [[r["unit"], r["stage"], r["models"], r["reason"]] for r in rows],
        ),
        "",
        _table(
            ["boundary param (cached)", "produced by"],
            [[p, plan.boundary_sources[p]] for p in plan.boundary_params],
        ),
        "",
        f"stage 1 loads: {', '.join(plan.models['stage1']) or '(none)'}; "
        f"never loads: {', '.join(plan.offload['stage1']) or '(none)'}",
        f"stage 2 loads: {', '.join(plan.models['stage2']) or '(none)'}; "
        f"never loads: {', '.join(plan.offload['stage2']) or '(none)'}",
    ]
    parts += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(parts)
