"""The `splitstage` command line: plan, stages, and the stage commands (parse, dispatch, report).

Run `splitstage --help`. User errors print one line `splitstage: error: ...` and exit with 2.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from splitstage.process.leaving import run_then_leave
from splitstage.splitter import (
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
ENVIRONMENT_ERRNOS = {  # OSErrors that name a path the user must fix, and how
    errno.ENOSPC: "no space left on the device; free space or point the path elsewhere",
    errno.EDQUOT: "disk quota exceeded; free space or point the path elsewhere",
    errno.EROFS: "read-only file system; point the path at a writable folder",
    errno.EACCES: "permission denied; make it writable or point the path elsewhere",
    errno.EPERM: "operation not permitted; make it writable or point the path elsewhere",
}
# Bad input from the user; anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError,)


class Parser(argparse.ArgumentParser):
    """argparse with bad arguments reported as ONE line `splitstage: error: ...`, exit 2."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse's hook
        command = self.prog.removeprefix("splitstage").strip()
        where = f"{command}: " if command else ""
        self.exit(EXIT_USAGE, f"splitstage: error: {where}{message} (see --help)\n")


def count(minimum: int):
    """An argparse type: an integer >= minimum, with a message naming the bound."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {number}")
        return number

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _read_json(path: str, what: str):
    """Read a JSON file, with errors that name the file and the problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserError(
            f"{what} {path}: not UTF-8 text (byte {error.start}); save it as UTF-8 JSON"
        ) from None
    except OSError as error:
        raise UserError(f"{what} {path}: cannot read it ({error.strerror or error})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}, column {error.colno}"
        raise UserError(f"{what} {path}: not valid JSON at {where}: {error.msg}") from None
    except RecursionError:
        raise UserError(f"{what} {path}: JSON nested too deeply to read") from None


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


def _shard(value: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/4, got {value!r}") from None
    if count < 1 or not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"shard {value}: need 0 <= I < N")
    return index, count


def cmd_preprocess(args: argparse.Namespace) -> int:
    """Stage 1: compute V2 outputs for samples not yet cached; print a one-line summary."""
    from splitstage.config.job import load_config
    from splitstage.tasks.stage1.preprocess import preprocess

    config = load_config(args.config)
    apply_overrides(args, config)
    skip_what_the_job_cannot_use(args, config)
    report = preprocess(
        config,
        workers=args.workers,
        shard=args.shard,
        progress=not args.json,
        verify=args.verify,
    )
    for warning in report.skipped_lines():
        print(f"splitstage: warning: {warning}", file=sys.stderr)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.line())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Stage 2: launch torchrun for this node, stream its output, print a summary."""
    from splitstage.config.job import load_config
    from splitstage.process.torchrun import TorchrunError
    from splitstage.tasks.launch.launcher import train

    config = load_config(args.config)
    apply_overrides(args, config)
    if args.nproc_per_node:
        config.train.nproc_per_node = args.nproc_per_node
    if args.mode:
        config.train.mode = args.mode
    try:
        report = train(config, run_id=args.run_id, node_rank=args.node_rank)
    except TorchrunError as error:
        print(f"splitstage: training failed: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.line())
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    """Show or check the cache of a job: statistics, or every shard's size, checksum and params
    against its index entry and the manifest. `verify` moves damaged entries to quarantine/ (no
    reader sees them again) so that the next preprocess recomputes their samples."""
    from splitstage.config.job import load_config
    from splitstage.tasks.cache.shard_format import CacheNotFoundError
    from splitstage.tasks.job_plan import make_plan, open_cache

    config = load_config(args.config)
    skip_what_the_job_cannot_use(args, config)
    plan = make_plan(config)
    store = open_cache(plan)
    fix = f"run `splitstage preprocess {args.config}`"
    store.require(fix)
    if args.action == "stats":
        stats = store.stats()
        print(json.dumps({"url": store.url, **stats.__dict__}, indent=2, default=str))
        return 0
    report = store.verify(params=plan.split.boundary_params)
    if not report.samples and not report.damaged:
        found = f"; the manifest lists {report.manifest_samples}" if report.manifest_samples else ""
        found += f"; {len(report.orphans)} shard files have none" if report.orphans else ""
        raise CacheNotFoundError(
            f"cache {store.url} holds no samples (no index entries{found}); {fix}"
        )
    report.quarantined = store.quarantine(report.damaged)
    for line in report.lines(fix):
        print(line)
    if report.quarantined:
        print(
            f"moved {len(report.quarantined)} damaged index entries (and their shards) to "
            f"{store.url}/quarantine/; {fix} to recompute their {len(report.lost)} samples"
        )
    return 0 if report.ok else 1


# Errors about the place the user named to write into, with what to change.
OUTPUT_PATH_ERRNOS = {
    errno.ENOENT: "a folder above it does not exist or cannot hold folders",
    errno.ENOTDIR: "a file stands where a folder is needed; choose another OUT_DIR",
    errno.EEXIST: "it exists and is not a folder; choose another OUT_DIR",
    errno.EISDIR: "a folder stands where a file is to be written; choose another OUT_DIR",
    **ENVIRONMENT_ERRNOS,
}


@contextlib.contextmanager
def writing_into(out_dir: str):
    """Create OUT_DIR first; an OSError while writing into it is one line naming the path."""
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        yield
    except OSError as error:
        if error.errno not in OUTPUT_PATH_ERRNOS:
            raise
        where = str(error.filename or out_dir)
        inside = "" if where == str(out_dir) else f"cannot write {where}: "
        raise UserError(f"OUT_DIR {out_dir}: {inside}{OUTPUT_PATH_ERRNOS[error.errno]}") from None


def cmd_data_digits(args: argparse.Namespace) -> int:
    """Write scikit-learn's handwritten digits as a DiffSynth-format image-caption data set."""
    from splitstage.data.digits import write_digits_dataset

    with writing_into(args.out_dir):
        count = write_digits_dataset(args.out_dir, limit=args.limit, size=args.size)
    print(f"wrote {count} samples to {args.out_dir} (metadata.csv + images/)")
    return 0


def cmd_demo_weights(args: argparse.Namespace) -> int:
    """Write the demo's weights: the autoencoder trained on the digits, and the DiT's init."""
    from splitstage.demo import write_demo_weights

    with writing_into(args.out_dir):
        paths = write_demo_weights(args.out_dir, seed=args.seed)
    print(", ".join(f"{name}: {path}" for name, path in paths.items()))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Check a job config and print its plan and cache key, without running anything."""
    from splitstage.config.job import load_config
    from splitstage.tasks.device import pick_device
    from splitstage.tasks.job_plan import make_plan
    from splitstage.tasks.stage2.models import planned_precision
    from splitstage.tasks.stage2.preflight import preflight

    config = load_config(args.config)
    apply_overrides(args, config)
    skip_what_the_job_cannot_use(args, config)
    plan = make_plan(config)
    checks = preflight(plan)
    device = pick_device()
    precision = planned_precision(plan.family, device)
    memory = checks.memory.to_dict() if checks.memory else None
    for warning in checks.warnings:
        print(f"splitstage: warning: {warning}", file=sys.stderr)
    if args.json:
        found = {**plan.summary(), "precision": precision, "memory": memory}
        print(json.dumps({**found, "warnings": checks.warnings}, indent=2))
        return 0
    print(plan_table(plan.split))
    print(f"cache key: {plan.cache_key}")
    for line in precision:
        print(f"stage 2 on {device.type}: {line}")
    for line in checks.memory.lines() if checks.memory else [checks.memory_note or ""]:
        print(line)
    print(f"checked: {', '.join(VALIDATED)}; only `train` checks: {', '.join(TRAIN_ONLY)}")
    return 0


def apply_overrides(args: argparse.Namespace, config) -> None:
    """The command line's overrides of the config (`--device-memory`)."""
    if getattr(args, "device_memory", None) is not None:
        config.train.device_memory = args.device_memory


def _size(value: str) -> int:
    """An argparse type: a size such as 24GiB or 80GB, or bytes."""
    from splitstage.config.job import parse_size

    try:
        return parse_size(value, "--device-memory")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--device-memory: ")) from None


VALIDATED = (  # what `validate` and a `train` rank's set-up both check (preflight)
    "the mesh",
    "the models and their weights files",
    "what is trained (LoRA targets and rank)",
    "the export",
    "the batches against the data set",
    "validation sampling",
    "each stage's device memory against train.device_memory",
)
TRAIN_ONLY = (  # what needs a run: its places, its lease, the cache it trains on
    "the cache holds exactly the data set (validate warns)",
    "outputs and checkpoints writable",
    "the resume point",
    "the run's lease",
)


def cmd_families(args: argparse.Namespace) -> int:
    """List the pipeline families a job may name, with their `[pipeline]` settings."""
    from splitstage.config.families import config_class, family_names
    from splitstage.config.pipeline_group import STAGE1

    for name in family_names():
        group = config_class(name)
        fields = {k: v for k, v in group.model_fields.items() if k != "name"}
        marks = [
            f"{k}{'*' if (v.json_schema_extra or {}).get(STAGE1) else ''}"
            for k, v in fields.items()
        ]
        print(f"{name}: {(group.__doc__ or '').strip().splitlines()[0]}")
        print(f"  settings: {', '.join(marks) or 'none'}  (* changes stage-1 outputs)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """All subcommands and their options."""
    parser = Parser(prog="splitstage", description="Two-stage split training for diffusion models.")
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
    source.add_argument("--num-layers", type=count(1), help="number of repeated layers")
    stages.add_argument("--layer-prefix", default="blocks")
    stages.add_argument("--input-modules", default="", help="modules before the layers")
    stages.add_argument("--output-modules", default="", help="modules after the layers")
    stages.add_argument("--num-stages", type=count(1), help="pipeline stages (or the PP degree)")
    stages.add_argument("--layers-per-stage", type=count(1))
    stages.add_argument("--first-stage-less-layers", type=count(0), default=1)
    stages.add_argument("--last-stage-less-layers", type=count(0), default=1)
    stages.add_argument("--validate", metavar="STAGES.json", help="check a given assignment")
    stages.set_defaults(run=cmd_stages)

    check = sub.add_parser("validate", help="check a job config; print its plan and cache key")
    check.add_argument("config", metavar="CONFIG.toml")
    check.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_device_memory(check)
    check.set_defaults(run=cmd_validate)

    fam = sub.add_parser("families", help="list the pipeline families and their settings")
    fam.set_defaults(run=cmd_families)

    pre = sub.add_parser("preprocess", help="stage 1: run V2 over the data set into the cache")
    pre.add_argument("config", metavar="CONFIG.toml")
    pre.add_argument("--shard", type=_shard, metavar="I/N", help="run only shard I of N")
    pre.add_argument("--workers", type=count(1), help="local worker processes (default: config)")
    pre.add_argument(
        "--verify",
        action="store_true",
        help="re-read every cached shard (default: only shards changed since their commit)",
    )
    pre.add_argument("--json", action="store_true", help="print the report as JSON")
    add_device_memory(pre)
    pre.set_defaults(run=cmd_preprocess)

    tr = sub.add_parser("train", help="stage 2: train V1 + the denoiser from the cache (torchrun)")
    tr.add_argument("config", metavar="CONFIG.toml")
    tr.add_argument("--run-id", help="names outputs and checkpoints (default: job.name)")
    tr.add_argument("--node-rank", type=count(0), default=0, help="this node's rank (multi-node)")
    tr.add_argument("--nproc-per-node", type=count(1), help="override train.nproc_per_node")
    tr.add_argument("--mode", choices=("split", "unsplit"), help="override train.mode")
    tr.add_argument("--json", action="store_true", help="print the report as JSON")
    add_device_memory(tr)
    tr.set_defaults(run=cmd_train)

    cache = sub.add_parser("cache", help="inspect a job's stage-1 cache")
    cache.add_argument("action", choices=("stats", "verify"))
    cache.add_argument("config", metavar="CONFIG.toml")
    cache.set_defaults(run=cmd_cache)

    data = sub.add_parser("data", help="example data sets")
    data_sub = data.add_subparsers(dest="dataset", required=True, metavar="DATASET")
    digits = data_sub.add_parser("digits", help="scikit-learn's 1,797 handwritten digits")
    digits.add_argument("out_dir", metavar="OUT_DIR")
    digits.add_argument("--limit", type=count(1), help="write only the first N samples")
    digits.add_argument("--size", type=count(8), default=64, help="image side in pixels")
    digits.set_defaults(run=cmd_data_digits)

    weights = sub.add_parser(
        "demo-weights",
        help="train the demo's autoencoder on the digits (seconds) and write it and the DiT's init",
    )
    weights.add_argument("out_dir", metavar="OUT_DIR")
    weights.add_argument("--seed", type=int, default=0)
    weights.set_defaults(run=cmd_demo_weights)
    return parser


def add_device_memory(parser: argparse.ArgumentParser) -> None:
    """The `--device-memory` override of train.device_memory."""
    parser.add_argument(
        "--device-memory",
        type=_size,
        metavar="SIZE",
        help="override train.device_memory (e.g. 24GiB): refuse a job estimated above it",
    )


def skip_what_the_job_cannot_use(args: argparse.Namespace, config) -> None:
    """In the console script's process (one job, then exit), mark the libraries this job cannot
    use absent (`splitstage/process/unused_imports.py`); never in a process that calls `main`
    again."""
    if getattr(args, "one_job", False):
        from splitstage.process.unused_imports import skip_unused_libraries

        skip_unused_libraries(config.model_dump(mode="json"))


def main(argv: Sequence[str] | None = None, *, one_job: bool = False) -> int:
    """Entry point of the `splitstage` console script (`one_job`: this process runs this one
    command and exits)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.one_job = one_job
    try:
        return args.run(args)
    except USER_ERRORS as error:
        print(f"splitstage: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:  # the machine, not the code: a full disk, a read-only folder
        if error.errno not in ENVIRONMENT_ERRNOS:
            raise
        where = error.filename or "a file"
        print(f"splitstage: error: {where}: {ENVIRONMENT_ERRNOS[error.errno]}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("splitstage: interrupted", file=sys.stderr)
        return 130


def console() -> None:
    """The `splitstage` console script: main(), the exit handlers, then leave without the
    interpreter's finalization (`run_then_leave`: no exit-134 abort from a torch thread)."""
    run_then_leave(lambda: main(one_job=True))


if __name__ == "__main__":
    console()
