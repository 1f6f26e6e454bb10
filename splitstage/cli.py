"""The `splitstage` command line: plan, stages, and the stage commands (parse, dispatch, report).

Run `splitstage --help`. User errors print one line `splitstage: error: ...` and exit with 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from splitter import (
    UserError,
    assign_stages,
    layout_from_count,
    layout_from_fqns,
    pipeline_from_dict,
    plan_split,
    plan_table,
    validate_stages,
)

EXIT_USAGE = 2


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _read_json(path: str, what: str):
    """Read a JSON file, with errors that name the file and the problem."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UserError(f"{what} {path}: cannot read it ({error.strerror or error})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}, column {error.colno}"
        raise UserError(f"{what} {path}: not valid JSON at {where}: {error.msg}") from None


def cmd_plan(args: argparse.Namespace) -> int:
    """Split a PIPELINE.json for the trainable models and print the plan."""
    pipeline = pipeline_from_dict(_read_json(args.pipeline, "pipeline file"))
    plan = plan_split(pipeline, args.trainable)
    if args.format == "json":
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan_table(plan))
    return 0


def cmd_stages(args: argparse.Namespace) -> int:
    """Assign module FQNs to pipeline-parallel stages, or validate a given assignment."""
    if args.modules_file:
        modules = _read_json(args.modules_file, "modules file")
        if not isinstance(modules, list):
            raise UserError(f"modules file {args.modules_file}: expected a JSON list of FQNs")
        layout = layout_from_fqns(modules)
    elif args.modules:
        layout = layout_from_fqns(_csv(args.modules))
    elif args.num_layers is not None:
        layout = layout_from_count(
            args.num_layers, args.layer_prefix, _csv(args.input_modules), _csv(args.output_modules)
        )
    else:
        raise UserError("stages: give --modules, --modules-file or --num-layers")
    if args.validate:
        parts = validate_stages(_read_json(args.validate, "stages file"), layout.modules)
    else:
        parts = assign_stages(
            layout,
            args.num_stages,
            layers_per_stage=args.layers_per_stage,
            first_stage_less_layers=args.first_stage_less_layers,
            last_stage_less_layers=args.last_stage_less_layers,
        )
    print(json.dumps({"num_stages": len(parts), "module_fqns_per_model_part": parts}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """All subcommands and their options."""
    parser = argparse.ArgumentParser(
        prog="splitstage", description="Two-stage split training for diffusion models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = sub.add_parser("plan", help="split a pipeline's units into V1 (trained) and V2 (cached)")
    plan.add_argument("pipeline", metavar="PIPELINE.json")
    plan.add_argument(
        "--trainable",
        default="",
        metavar="NAME[,NAME...]",
        help="models that get gradients (full or LoRA base); empty: everything is cached",
    )
    plan.add_argument("--format", choices=("table", "json"), default="table")
    plan.set_defaults(run=cmd_plan)

    stages = sub.add_parser("stages", help="assign module FQNs to pipeline-parallel stages (JSON)")
    source = stages.add_mutually_exclusive_group()
    source.add_argument("--modules", help="ordered module FQNs, comma-separated")
    source.add_argument("--modules-file", help="JSON list of ordered module FQNs")
    source.add_argument("--num-layers", type=int, help="number of repeated layers")
    stages.add_argument("--layer-prefix", default="blocks")
    stages.add_argument("--input-modules", default="", help="modules before the layers")
    stages.add_argument("--output-modules", default="", help="modules after the layers")
    stages.add_argument("--num-stages", type=int, help="pipeline stages (or the PP degree)")
    stages.add_argument("--layers-per-stage", type=int)
    stages.add_argument("--first-stage-less-layers", type=int, default=1)
    stages.add_argument("--last-stage-less-layers", type=int, default=1)
    stages.add_argument("--validate", metavar="STAGES.json", help="check a given assignment")
    stages.set_defaults(run=cmd_stages)

    for register in EXTRA_COMMANDS:
        register(sub)
    return parser


EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `splitstage` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UserError as error:
        print(f"splitstage: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("splitstage: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
