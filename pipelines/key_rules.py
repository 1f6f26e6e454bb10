"""Key maps with slice rules: a model key read as rows of one or more file tensors, found by
running a checkpoint converter on a row-id proxy of the file's header (no weights read).

A converter that renames, splits along dim 0 (fused qkv -> q, k, v), reorders row blocks (shift/
scale swaps) or drops trailing size-1 dims (a 1x1 conv read as a linear) is recorded exactly: each
proxy tensor holds, per row, a number naming (file key, row); whatever the converter returns names
where each output row came from. Anything else (arithmetic, transposes) is refused, never guessed.
Each rank then reads only the rows and columns its shard needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


class KeyRuleError(ValueError):
    """The converter did something a slice rule cannot express; the message says what."""


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of the file tensor `key`."""

    key: str
    start: int
    stop: int


@dataclass(frozen=True)
class Rule:
    """A model tensor: its pieces stacked along dim 0, keeping `ndim` dims of the file's."""

    pieces: tuple[Piece, ...]
    ndim: int

    def is_rename(self, shapes: Mapping[str, tuple[int, ...]]) -> bool:
        """True when the model tensor is one whole file tensor under another name."""
        if len(self.pieces) != 1:
            return False
        piece = self.pieces[0]
        shape = shapes[piece.key]
        rows = shape[0] if shape else 1
        return piece.start == 0 and piece.stop == rows and len(shape) == self.ndim

    def shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The model tensor's shape, from the file's header shapes."""
        first = shapes[self.pieces[0].key]
        if self.ndim == 0:
            return ()
        rows = sum(p.stop - p.start for p in self.pieces)
        return (rows, *first[1 : self.ndim])

    def read(
        self,
        read: Callable[[str, tuple[slice, ...] | None], torch.Tensor],
        shapes: Mapping[str, tuple[int, ...]],
        region: tuple[slice, ...] | None,
    ) -> torch.Tensor:
        """The model tensor, or only `region` of it, reading only the file rows it covers."""
        if self.ndim == 0:
            return read(self.pieces[0].key, None)
        full = self.shape(shapes)
        region = region or tuple(slice(0, n) for n in full)
        lo, hi, _ = region[0].indices(full[0])
        parts, offset = [], 0
        for piece in self.pieces:
            length = piece.stop - piece.start
            a, b = max(lo, offset), min(hi, offset + length)
            if a < b or (not parts and piece is self.pieces[-1]):  # an empty shard: 0 rows
                b = max(a, b)
                src_rows = slice(piece.start + a - offset, piece.start + b - offset)
                extra = len(shapes[piece.key]) - self.ndim  # trailing size-1 dims dropped
                part = read(piece.key, (src_rows, *region[1:], *(slice(None),) * extra))
                parts.append(part.reshape(part.shape[: self.ndim]))
            offset += length
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def derive_rules(
    convert: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    row_scale: int = 1,
) -> dict[str, Rule]:
    """{output key: Rule} of `convert` applied to a file whose header gives `shapes`.

    `row_scale` runs the converter on proxies with that many times the rows (a converter that
    hard-codes a width, as diffusers' FLUX one does 3072, then reads a narrower model's file);
    every recorded boundary must divide by it.
    """
    keys = sorted(shapes)
    offsets, proxy, start = [], {}, 0
    for key in keys:
        shape = tuple(shapes[key])
        rows = shape[0] * row_scale if shape else 1
        ids = torch.arange(start, start + rows, dtype=torch.int64)
        proxy[key] = ids.reshape(()) if not shape else ids.reshape(rows, *[1] * (len(shape) - 1))
        offsets.append(start)
        start += rows
    out = convert(proxy)
    bounds = torch.tensor([*offsets, start], dtype=torch.int64)
    return {name: _rule_of(name, tensor, keys, bounds, row_scale) for name, tensor in out.items()}


def _rule_of(name: str, tensor, keys: list[str], bounds: torch.Tensor, scale: int) -> Rule:
    """The pieces a converted proxy tensor's row ids name (contiguous runs of one file key)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64:
        raise KeyRuleError(f"{name}: the converter computed it (not a copy of file rows)")
    if tensor.numel() != (tensor.shape[0] if tensor.ndim else 1):
        raise KeyRuleError(f"{name}: the converter rearranged it beyond rows (a transpose?)")
    ids = tensor.reshape(-1)
    if ids.numel() and (ids.min() < 0 or ids.max() >= bounds[-1]):
        raise KeyRuleError(f"{name}: the converter changed values (not a copy of file rows)")
    which = torch.searchsorted(bounds, ids, right=True) - 1
    rows = ids - bounds[which]
    # runs of consecutive rows of one file tensor, found at once (a real model has millions)
    breaks = (which[1:] != which[:-1]) | (rows[1:] != rows[:-1] + 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1])
    starts = starts[: ids.numel()]  # an empty tensor reads no rows
    ends = torch.cat([starts[1:], torch.tensor([ids.numel()])])[: starts.numel()]
    pieces = zip(which[starts].tolist(), rows[starts].tolist(), (rows[ends - 1] + 1).tolist())
    found = []
    scale = scale if tensor.ndim else 1  # a 0-d tensor's proxy is one id, unscaled
    for w, a, b in pieces:
        if a % scale or b % scale:
            raise KeyRuleError(f"{name}: its rows of {keys[w]} do not scale by {scale}")
        found.append(Piece(keys[w], a // scale, b // scale))
    return Rule(tuple(found), tensor.ndim)
