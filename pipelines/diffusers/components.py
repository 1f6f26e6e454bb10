"""Building diffusers / transformers components from a folder: loaded and frozen, or on meta."""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from splitstage.config.job import ConfigError
from splitstage.pipelines.diffusers.single_file import SingleFileError, single_file_rules
from splitstage.pipelines.key_rules import Rule
from splitstage.pipelines.model_buffers import keep_buffers, restore_buffers
from splitstage.storage.safetensors_io import drop_mapped_pages, is_index_path, mapped_state

LIBRARIES = ("diffusers", "transformers")


class Component(Protocol):
    """What building needs of a component (folder.Component is one; folder checks overrides
    with `check_fits`, so this module does not import the folder)."""

    name: str
    library: str
    class_name: str
    config_dir: Path
    weights: Path | None

    @property
    def source(self) -> str: ...

    def weight_files(self) -> list[Path]: ...


def component_class(component: Component) -> type[nn.Module]:
    """The model class model_index.json names, from diffusers or transformers."""
    if component.library not in LIBRARIES:
        raise ConfigError(
            f"models.{component.name}: model_index.json names library {component.library!r}; "
            f"only {', '.join(LIBRARIES)} components are built"
        )
    module = importlib.import_module(component.library)
    try:
        return getattr(module, component.class_name)
    except AttributeError:
        raise ConfigError(
            f"models.{component.name}: {component.library} has no class {component.class_name} "
            "(model_index.json); upgrade it or fix the folder"
        ) from None


def build_empty(component: Component) -> nn.Module:
    """The component's architecture with parameters on the meta device (no weights read).

    Buffers are built for real (accelerate's `init_empty_weights`), and the non-persistent ones
    (CLIP's position ids, SD3's positional table, ...) are kept aside: no weights file holds
    them, and `to_empty` turns them into garbage, so `init_buffers` puts them back.
    """
    from accelerate import init_empty_weights

    cls = component_class(component)
    try:
        with init_empty_weights(include_buffers=False):
            if component.library == "diffusers":
                model = cls.from_config(cls.load_config(component.config_dir))
            else:
                model = cls(cls.config_class.from_pretrained(component.config_dir))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RuntimeError) as error:
        raise ConfigError(
            f"{component.source}: cannot build {component.class_name} from "
            f"{component.config_dir / 'config.json'} ({_first_line(error)}); fix that config.json "
            "or use the one diffusers saved with the weights"
        ) from None
    model = keep_buffers(model)
    # Stage 2's loader reads an original-layout single file through diffusers' converter.
    model.original_layout_rules = functools.partial(single_file_rules, model)
    return model


def file_shapes(component: Component) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the component's weights files, from their headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in component.weight_files():
        if is_index_path(str(path)):
            continue
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for key in handle.keys():  # noqa: SIM118
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except (OSError, SafetensorError) as error:
            raise ConfigError(
                f"{component.source}: {path} is not a readable safetensors file "
                f"({_first_line(error)}); give the weights as diffusers saves them"
            ) from None
    return shapes


def check_fits(component: Component) -> None:
    """The weights files hold exactly the architecture's tensors, shapes included (headers only:
    an override that does not fit is refused before anything is launched)."""
    model = build_empty(component)
    shapes = file_shapes(component)
    rules = _original_layout(component, model, shapes)
    if rules is not None:
        shapes = {key: rule.shape(shapes) for key, rule in rules.items()}
    _refuse_misfit(component, model, shapes)


def _original_layout(component: Component, model: nn.Module, shapes) -> dict[str, Rule] | None:
    """The key rules of an original-layout single file (diffusers' converter), else None."""
    if not _match_keys(model, shapes)[0]:
        return None
    try:
        found = single_file_rules(model, shapes)
    except SingleFileError as error:
        raise ConfigError(f"{component.source}: {component.weights}: {error}") from None
    return None if found is None else found[0]


def init_buffers(model: nn.Module) -> None:
    """Put back the non-persistent buffers `build_empty` kept; re-tie T5's embeddings."""
    restore_buffers(model, type(model).__name__)
    tie = getattr(model, "tie_weights", None)
    if callable(tie) and not hasattr(model, "register_to_config"):  # transformers models only
        tie()


def load_frozen(component: Component, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The component built on meta, loaded from its weights (exactly: strict keys), frozen."""
    model = build_empty(component)
    state = mapped_state(component.weights)
    file_views = {t.data_ptr() for t in state.values()}
    shapes = {key: tuple(t.shape) for key, t in state.items()}
    rules = _original_layout(component, model, shapes)
    if rules is not None:
        state = {
            k: rule.read(lambda n, r: state[n][r or ()], shapes, None) for k, rule in rules.items()
        }
    _refuse_misfit(component, model, {key: tuple(t.shape) for key, t in state.items()})
    model.load_state_dict(state, strict=False, assign=True)
    state.clear()  # the model holds what it needs: no second reference to the file
    init_buffers(model)
    place(model, device, None if dtype == torch.float32 else dtype, file_views)
    _check_materialized(model, component)
    return model.eval().requires_grad_(False)


def place(
    model: nn.Module, device: torch.device, dtype: torch.dtype | None, file_views: set[int]
) -> None:
    """Each tensor to `device` and its floating ones to `dtype` (None: as the file holds them),
    one at a time: a file tensor that had to be copied hands its mapped pages back at once, so
    the file is never resident beside a whole converted copy; one that needs no change stays a
    view of the file."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is None:
                    continue
                held = tensor.data
                target = dtype if dtype is not None and held.is_floating_point() else held.dtype
                moved = held.to(device=device, dtype=target)
                if moved.data_ptr() == held.data_ptr():
                    continue
                if isinstance(tensor, nn.Parameter):
                    tensor.data = moved
                else:
                    table[key] = moved
                if held.data_ptr() in file_views:  # never anonymous memory: it would read 0
                    drop_mapped_pages(held)


def _refuse_misfit(
    component: Component, model: nn.Module, shapes: dict[str, tuple[int, ...]]
) -> None:
    """One line when the file's keys or shapes are not the architecture's."""
    missing, unexpected = _match_keys(model, shapes)
    expected = model.state_dict()
    wrong = [
        f"{k} {shapes[k]} vs {tuple(expected[k].shape)}"
        for k in sorted(set(shapes) & set(expected))
        if shapes[k] != tuple(expected[k].shape)
    ]
    found = [
        f"{what} {_few(keys)}"
        for what, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
        if keys
    ]
    if found:
        raise ConfigError(
            f"{component.source}: {component.weights} does not fit {component.class_name} "
            f"({'; '.join(found)}); it must be a diffusers-layout state dict of this architecture, "
            "or an original single file of a FLUX / SD3 transformer or an SD UNet"
        )


def _match_keys(model: nn.Module, state: dict[str, object]) -> tuple[list[str], list[str]]:
    """Model keys the file lacks (tied copies excused) and file keys the model lacks."""
    expected = set(model.state_dict())
    tied = _tied_keys(model)
    missing = sorted(k for k in expected - set(state) if k not in tied)
    unexpected = sorted(set(state) - expected)
    return missing, unexpected


def _tied_keys(model: nn.Module) -> set[str]:
    """Parameter names sharing storage with another name (e.g. T5's embed_tokens = shared)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        else:
            seen[id(param)] = name
    declared = getattr(model, "_tied_weights_keys", None) or ()
    if isinstance(declared, dict):
        declared = list(declared)
    return tied | {k for k in declared if isinstance(k, str)}


def _check_materialized(model: nn.Module, component: Component) -> None:
    """No tensor is still on meta after loading (a tied key the file lacked, left empty)."""
    left = [name for name, t in model.state_dict().items() if t.is_meta]
    if left:
        raise ConfigError(
            f"{component.source}: {component.weights} lacks {_few(left)} of "
            f"{component.class_name}; give the complete weights"
        )


def _first_line(error: BaseException) -> str:
    """An exception's message, its first line only (messages are one line)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _few(keys: list[str], limit: int = 3) -> str:
    if not keys:
        return "none"
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more
