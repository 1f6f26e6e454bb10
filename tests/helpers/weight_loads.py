"""Watch this process for model weights being read, patching nothing: a profile hook records each
call of the functions that read tensors from a model file (torch.load, safetensors' loaders and
`safe_open.get_tensor`, DiffSynth's and diffusers' / transformers' loaders, stage 2's loader)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# (module, qualified name) of the Python functions that read weights from a file.
WATCHED = {
    ("torch.serialization", "load"),
    ("safetensors.torch", "load_file"),
    ("safetensors.torch", "load"),
    ("splitstage.tasks.stage2.pretrained_weights", "materialize_and_load"),
    ("diffsynth.models.model_loader", "ModelPool.auto_load_model"),
    ("diffsynth.core.loader.model", "load_model"),
    ("diffusers.models.modeling_utils", "ModelMixin.from_pretrained"),
    ("transformers.modeling_utils", "PreTrainedModel.from_pretrained"),
}
NAMES = {qualname.rsplit(".", 1)[-1] for _, qualname in WATCHED}
C_WATCHED = {("safe_open", "get_tensor")}  # safetensors' reader (Rust): a C call


@contextmanager
def weight_loads() -> Iterator[list[str]]:
    """The list of weight-reading calls made in this thread (and threads it starts) meanwhile."""
    seen: list[str] = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name in NAMES:
            where = (frame.f_globals.get("__name__"), frame.f_code.co_qualname)
            if where in WATCHED:
                seen.append(".".join(where))
        elif event == "c_call" and getattr(arg, "__name__", None) == "get_tensor":
            owner = type(getattr(arg, "__self__", None)).__name__
            if (owner, "get_tensor") in C_WATCHED:
                seen.append(f"{owner}.get_tensor")

    previous = sys.getprofile()
    sys.setprofile(hook)
    threading.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)
