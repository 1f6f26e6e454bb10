"""A checkpoint's non-tensor state (scheduler, position, RNG) as safetensors + JSON, no pickle."""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

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
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    tensors = st_load(blob)
    return _decode(json.loads(header["__metadata__"]["json"]), tensors)


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
