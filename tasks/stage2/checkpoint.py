"""Resumable, reshardable training checkpoints (torch DCP) on any fsspec URL (path, file://, s3://).

Layout: `<url>/step-00000100/` holds DCP's files (`.metadata`, `__<rank>_0.distcp`),
`extra.safetensors` (the caller's `extra_state`), one `rng-rank00000.safetensors` per rank
(torch CPU/CUDA, python, numpy RNG), and `COMPLETE`, written last. A directory without `COMPLETE`
and `.metadata` is an unfinished save: ignored and deleted. Everything this module writes is JSON
or safetensors (no pickle); DCP's own `.metadata` is torch's format. Local paths must be shared by
all nodes of a multi-node job. `storage_options` may name a credentials block (the run spec's,
see `tasks.stage2.outputs.output_storage_options`): each process reads its credentials when it
opens the URL. A checkpoint's non-tensor state (scheduler, position, RNG) is safetensors + JSON.
`Checkpointer` is what a training loop holds: it saves on its own cadence and restores the named
`Stateful` parts of a run (torchtitan's CheckpointManager).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from splitstage.splitter import UserError
from splitstage.storage.files import (
    StorageError,
    ensure_folder,
    join,
    open_fs,
    storage_errors,
    write_atomic,
)
from splitstage.storage.options import resolve_credentials
from splitstage.storage.safetensors_io import read_metadata
from splitstage.tasks.stage2.distributed import comm_device
from splitstage.tasks.stage2.safe_dcp import SafeFsspecReader, SafeFsspecWriter

FORMAT = 1  # of the extra-state blob and the checkpoint's COMPLETE marker


def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """JSON-able tree; tensors/ndarrays go to `tensors` and are referenced by name."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().cpu().contiguous()
        return {"__tensor__": name}
    try:
        import numpy as np
    except ImportError:  # numpy is optional here
        np = None
    if np is not None and isinstance(obj, np.ndarray):
        return {"__ndarray__": _encode(torch.from_numpy(obj.copy()), tensors, where)}
    if np is not None and isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in obj.items()}
        return {
            "__items__": [
                [_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")]
                for k, v in obj.items()
            ]
        }
    raise TypeError(
        f"{where} is a {type(obj).__name__}; checkpoints store only JSON values, tuples, "
        "tensors and numpy arrays (no pickle): convert it, e.g. with its state_dict()"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of _encode."""
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return _decode(obj["__ndarray__"], tensors).numpy()
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def pack_extra(tree: Any, where: str) -> bytes:
    """A tree of JSON values and tensors as one safetensors blob (JSON in its metadata)."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, tensors, where)
    return st_save(tensors, metadata={"json": json.dumps(encoded), "format": str(FORMAT)})


def unpack_extra(blob: bytes) -> Any:
    """Inverse of pack_extra (reads the safetensors header's metadata, then the tensors)."""
    tensors = st_load(blob)
    return _decode(json.loads(read_metadata(blob)["json"]), tensors)


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, its current CUDA device (if used), python, numpy."""
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device only: no new contexts
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned, so random draws continue bitwise identically."""
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
METADATA = ".metadata"
EXTRA = "extra.safetensors"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, unfinished or damaged; the message names its directory."""


def step_dir(step: int) -> str:
    """The directory name of a step's checkpoint (zero-padded, so names sort by step)."""
    return f"step-{step:08d}"


def _rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's 'assuming a single process' warning (expected without a process group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _on_all_ranks(fn: Callable[[], object], ckpt_url: str) -> None:
    """Run fn on every rank, then agree: all ranks raise if any failed (never a lone hang)."""
    error: BaseException | None = None
    try:
        fn()
    except Exception as exc:
        error = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.tensor([int(error is not None)], device=comm_device())
        dist.all_reduce(failed)
        if int(failed.item()):  # every rank learns the first failing rank's reason (a str)
            reasons: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(reasons, None if error is None else str(error))
            if error is None:
                rank, reason = next((r, m) for r, m in enumerate(reasons) if m is not None)
                raise CheckpointError(f"rank {rank}: {reason}")
    if error is not None:
        raise error


def _rng_name(rank: int) -> str:
    """File name of one rank's RNG state."""
    return f"rng-rank{rank:05d}.safetensors"


def _as_list(optimizers) -> list[torch.optim.Optimizer]:
    """None, one optimizer or several -> a list."""
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def _options(lora_only: bool) -> StateDictOptions:
    """LoRA-only checkpoints skip frozen params and load non-strictly. Optimizer state is flat
    (`state.<fqn>.*`, `param_groups.<fqn>.*`), so ranks holding different modules (pipeline
    stages) write disjoint keys instead of each one's `param_groups` list under one key."""
    return StateDictOptions(
        ignore_frozen_params=lora_only, strict=not lora_only, flatten_optimizer_state_dict=True
    )


def _state(model: nn.Module, optimizers: list, lora_only: bool) -> dict[str, Any]:
    """The DCP state dict: sharded model (and optimizer) state, keyed by plain FQNs."""
    if not optimizers:
        return {"model": get_model_state_dict(model, options=_options(lora_only))}
    msd, osd = get_state_dict(model, optimizers, options=_options(lora_only))
    return {"model": msd, "optim": osd}


# -- JSON + tensors encoding of extra_state and RNG state (no pickle)


# -- listing and cleaning


def _scan(fs, root: str) -> tuple[dict[int, str], dict[int, str]]:
    """(complete, incomplete) step -> directory path under root."""
    fs.invalidate_cache()
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}, {}
    complete, incomplete = {}, {}
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        match = _STEP_DIR.match(name)
        if not match or entry.get("type") != "directory":
            continue
        path = entry["name"].rstrip("/")
        try:
            names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
        except FileNotFoundError:  # deleted since the listing (rank 0 cleaning up)
            continue
        target = complete if {COMPLETE, METADATA} <= names else incomplete
        target[int(match.group(1))] = path
    return complete, incomplete


def _remove(fs, path: str) -> None:
    """Delete a checkpoint dir, marker first, so a crash mid-delete leaves an ignored dir."""
    marker = join(path, COMPLETE)
    if fs.exists(marker):
        fs.rm(marker)
    fs.rm(path, recursive=True)


def _prune(fs, root: str, keep_last: int) -> list[int]:
    """Delete unfinished checkpoints and all but the newest `keep_last` complete ones."""
    complete, incomplete = _scan(fs, root)
    doomed = sorted(complete)[:-keep_last] + sorted(incomplete)
    for step in doomed:
        _remove(fs, complete.get(step) or incomplete[step])
    return doomed


def latest_checkpoint(
    url: str, *, storage_options: Mapping[str, Any] | None = None, clean: bool = True
) -> int | None:
    """The newest complete checkpoint's step, or None; rank 0 deletes unfinished ones (`clean`)."""
    storage_options = resolve_credentials(url, storage_options)
    fs, root = open_fs(url, storage_options)
    with storage_errors(url, "list checkpoints in", storage_options):
        complete, incomplete = _scan(fs, root)
        if clean and _rank() == 0:
            for step in sorted(incomplete):
                log.info("deleting unfinished checkpoint %s", incomplete[step])
                _remove(fs, incomplete[step])
    return max(complete) if complete else None


# -- save / load


def save_checkpoint(
    url: str,
    step: int,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
    extra_state: Mapping[str, Any] | None = None,
    *,
    keep_last: int = 3,
    lora_only: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    save_rng: bool = True,
) -> str:
    """Save model + optimizers + extra_state (+ each rank's RNG) as step `step`; collective.

    extra_state: JSON values, tuples, tensors, numpy arrays (scheduler state, data position).
    Returns the checkpoint URL. Older checkpoints beyond `keep_last` go after this one is complete.
    """
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"train.keep_checkpoints must be an integer >= 1, got {keep_last!r}")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    extra_blob = pack_extra(dict(extra_state or {}), "extra_state")  # fail early on bad values
    storage_options = resolve_credentials(url, storage_options)  # DCP's writer gets them too
    fs, root = open_fs(url, storage_options)
    path, ckpt_url = join(root, step_dir(step)), f"{url.rstrip('/')}/{step_dir(step)}"
    try:
        _write_checkpoint(
            fs,
            path,
            ckpt_url,
            step,
            model,
            optimizers,
            extra_blob,
            lora_only,
            save_rng,
            storage_options,
        )
    except StorageError as error:  # a full, read-only or forbidden place: the older ones stay
        raise _with_kept(error, fs, root, path) from None
    except BaseException:
        _discard(fs, path)
        raise
    if _rank() == 0:
        try:
            _prune(fs, root, keep_last)
        except Exception as exc:  # the new checkpoint is complete; pruning can wait for the next
            log.warning("could not delete old checkpoints under %s: %s", url, exc)
    return ckpt_url


def _discard(fs, path: str) -> None:
    """Rank 0 deletes a checkpoint whose save failed (all ranks have stopped writing it), so
    the space it held comes back; a failure to delete is left to the next start's clean-up."""
    if _rank() == 0:
        with contextlib.suppress(Exception):
            _remove(fs, path)


def _with_kept(error: StorageError, fs, root: str, path: str) -> StorageError:
    """`error` (its class, errno kept) with what is left: the unfinished files deleted, the
    newest complete checkpoint (which the next start resumes from) named."""
    _discard(fs, path)
    try:
        complete, _ = _scan(fs, root)
    except Exception:  # the listing fails too: say what failed, nothing more
        return error
    kept = (
        f"the last complete checkpoint, {step_dir(max(complete))}, is intact and a rerun "
        "resumes from it"
        if complete
        else "no earlier checkpoint exists"
    )
    try:
        again = type(error)(f"{error}; {kept}")
    except Exception:  # a class that takes other arguments
        return error
    again.errno = error.errno
    return again


def _write_checkpoint(
    fs,
    path: str,
    ckpt_url: str,
    step: int,
    model: nn.Module,
    optimizers,
    extra_blob: bytes,
    lora_only: bool,
    save_rng: bool,
    storage_options: Mapping[str, Any] | None,
) -> None:
    """Write step `step`'s files, COMPLETE last (collective); storage failures as StorageErrors
    naming the checkpoint."""
    with storage_errors(ckpt_url, "write checkpoint", storage_options):
        _on_all_ranks(lambda: _rank() == 0 and fs.exists(path) and _remove(fs, path), ckpt_url)
        state = _state(model, _as_list(optimizers), lora_only)
        # DCP's writer makedirs the folder, which on s3fs creates a missing bucket: check first
        field = "train.checkpoint_url (default: under output.url)"
        ensure_folder(fs, path, ckpt_url, storage_options, field=field)
        writer = SafeFsspecWriter(ckpt_url, **dict(storage_options or {}))
        with _single_process_quiet():
            dcp.save(state, storage_writer=writer)  # DCP raises on every rank if one fails

        def write_own_files() -> None:
            if save_rng:
                write_atomic(fs, join(path, _rng_name(_rank())), pack_extra(rng_state(), "rng"))
            if _rank() == 0:
                write_atomic(fs, join(path, EXTRA), extra_blob)

        _on_all_ranks(write_own_files, ckpt_url)
        marker = {
            "format": FORMAT,
            "step": step,
            "world_size": _world(),
            "lora_only": lora_only,
            "rng": save_rng,
            "time": time.time(),
        }
        complete = join(path, COMPLETE)
        _on_all_ranks(
            lambda: _rank() == 0 and write_atomic(fs, complete, json.dumps(marker).encode()),
            ckpt_url,
        )


def _read_marker(fs, path: str, ckpt_url: str) -> dict[str, Any]:
    """The COMPLETE marker, or a CheckpointError saying the checkpoint is unfinished."""
    if not fs.exists(join(path, COMPLETE)) or not fs.exists(join(path, METADATA)):
        raise CheckpointError(
            f"checkpoint {ckpt_url} is unfinished or missing (no {COMPLETE} marker or "
            f"{METADATA}); resume from latest_checkpoint() instead"
        )
    return json.loads(fs.cat_file(join(path, COMPLETE)))


def _check_files(fs, path: str, ckpt_url: str, reader: SafeFsspecReader, marker) -> None:
    """Every file the checkpoint needs exists, else a CheckpointError naming the missing ones."""
    metadata = reader.read_metadata()
    needed = {info.relative_path for info in (metadata.storage_data or {}).values()}
    needed.add(EXTRA)
    if marker.get("rng") and marker.get("world_size") == _world():
        needed.update(_rng_name(r) for r in range(_world()))  # all ranks agree on the verdict
    present = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    missing = sorted(needed - present)
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt_url} is damaged: missing {', '.join(missing[:5])}; restore those "
            f"files, or delete {ckpt_url} to resume from the previous checkpoint"
        )


def _unsaved_optimizer_state(state: dict[str, Any], reader: SafeFsspecReader) -> dict[str, Any]:
    """The optimizer state entries the checkpoint does not hold, taken out of `state` (DCP
    refuses keys it lacks): those of trained parameters that had no gradient yet when it was
    saved (a LoRA on a block output nothing reads, e.g. Qwen-Image's last text stream), whose
    optimizer had made no state for them; torch's state-dict API fills every parameter's."""
    saved = set(reader.read_metadata().state_dict_metadata)
    optim = state["optim"]
    keys = [k for k in optim if k.startswith("state.") and f"optim.{k}" not in saved]
    return {key: optim.pop(key) for key in keys}


def _forget_unstepped(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], unsaved: Mapping[str, Any]
) -> None:
    """Drop the placeholder state `set_state_dict` gave the parameters the checkpoint holds no
    state for, so their first gradient starts their state as in a run never interrupted."""
    if not unsaved:
        return
    fqns = {key.removeprefix("state.").rsplit(".", 1)[0] for key in unsaved}
    for name, param in model.named_parameters():
        if _get_fqns(model, name) & fqns:
            for optimizer in optimizers:
                optimizer.state.pop(param, None)


def load_checkpoint(
    url: str,
    step: int,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load step `step` into the (parallelized) model and optimizers; return its extra_state.

    Any world size or layout can load (DCP reshards). RNG states come back only on the world size
    they were saved with (then resume is bitwise identical).
    """
    optimizers = _as_list(optimizers)
    storage_options = resolve_credentials(url, storage_options)  # DCP's reader gets them too
    fs, root = open_fs(url, storage_options)
    path, ckpt_url = join(root, step_dir(step)), f"{url.rstrip('/')}/{step_dir(step)}"
    with storage_errors(ckpt_url, "read checkpoint", storage_options):
        marker = _read_marker(fs, path, ckpt_url)
        reader = SafeFsspecReader(ckpt_url, **dict(storage_options or {}))
        _check_files(fs, path, ckpt_url, reader, marker)
        lora_only = bool(marker.get("lora_only"))
        state = _state(model, optimizers, lora_only)
        unsaved = _unsaved_optimizer_state(state, reader) if optimizers else {}
        try:
            with _single_process_quiet():
                dcp.load(state, storage_reader=reader)
        except Exception as exc:
            raise CheckpointError(f"cannot load checkpoint {ckpt_url}: {exc}") from exc
        if optimizers:
            set_state_dict(
                model,
                optimizers,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"] | unsaved,
                options=_options(lora_only),
            )
            _forget_unstepped(model, optimizers, unsaved)
        else:
            set_model_state_dict(model, state["model"], options=_options(lora_only))
        extra = unpack_extra(fs.cat_file(join(path, EXTRA)))
        if restore_rng and marker.get("rng"):
            if marker.get("world_size") == _world():
                set_rng_state(unpack_extra(fs.cat_file(join(path, _rng_name(_rank())))))
            elif _rank() == 0:
                log.warning(
                    "checkpoint %s was saved on %s ranks, this job has %d: RNG states not restored",
                    ckpt_url,
                    marker.get("world_size"),
                    _world(),
                )
    return extra


def read_extra_state(
    url: str, step: int, *, storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The extra_state of checkpoint `step` alone (no model, no process group): for checks
    before launch."""
    storage_options = resolve_credentials(url, storage_options)
    fs, root = open_fs(url, storage_options)
    path = join(root, step_dir(step))
    with storage_errors(f"{url.rstrip('/')}/{step_dir(step)}", "read checkpoint", storage_options):
        return unpack_extra(fs.cat_file(join(path, EXTRA)))


class Stateful(Protocol):
    """A part of a run with its own checkpointed state (torch.distributed.checkpoint's
    `Stateful`): JSON values, tuples, tensors and numpy arrays."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    """A run's checkpoints under `url`: `save(update, last=...)` writes one when it is due
    (every `every` updates, and the last), holding the model and optimizers (DCP: resharded on
    load) and each named part's `state_dict()`, plus `recorded` values (the run's settings, read
    by the checks before a resume); `load()` restores the newest complete one into them."""

    def __init__(
        self,
        url: str,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        parts: Mapping[str, Stateful],
        *,
        every: int,
        keep_last: int,
        lora_only: bool,
        storage_options: Mapping[str, Any] | None = None,
        recorded: Mapping[str, Any] | None = None,
    ):
        self.url, self.model, self.optimizers = url, model, optimizers
        self.parts, self.recorded = dict(parts), dict(recorded or {})
        self.every, self.keep_last, self.lora_only = every, keep_last, lora_only
        self.storage_options = storage_options

    def due(self, update: int, *, last: bool = False) -> bool:
        """Whether `update` is checkpointed: every `every` updates, and the last."""
        return last or update % self.every == 0

    def save(self, update: int, *, last: bool = False) -> str | None:
        """Checkpoint `update` if it is due (collective); its URL, or None."""
        if not self.due(update, last=last):
            return None
        state = {name: part.state_dict() for name, part in self.parts.items()}
        return save_checkpoint(
            self.url,
            update,
            self.model,
            self.optimizers,
            {**self.recorded, **state},
            keep_last=self.keep_last,
            lora_only=self.lora_only,
            storage_options=self.storage_options,
        )

    def load(self) -> int | None:
        """Restore the newest complete checkpoint into the model, the optimizers and every part
        it holds a state for (a part it lacks, such as an EMA added to the config since, keeps
        its fresh state); its step, or None when there is none."""
        step = self.latest(clean=True)
        if step is None:
            return None
        extra = load_checkpoint(
            self.url, step, self.model, self.optimizers, storage_options=self.storage_options
        )
        for name, part in self.parts.items():
            if extra.get(name) is not None:
                part.load_state_dict(extra[name])
        return step

    def latest(self, *, clean: bool = False) -> int | None:
        """The newest complete checkpoint's step, or None (`clean`: rank 0 deletes unfinished
        ones)."""
        return latest_checkpoint(self.url, storage_options=self.storage_options, clean=clean)
