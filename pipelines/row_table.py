"""A data set's rows kept as columns and made into `Row` objects only when one is used: what a
rerun of 10^6 rows restores from the index memo without building a million objects (or even
splitting its text columns) up front."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any, overload

import numpy as np

from splitstage.pipelines.data import Row

_SEP = "\0"


class RowTable(Sequence[Row]):
    """Rows as columns: line numbers, and image paths, prompts and extra fields (JSON text or
    '') as NUL-joined UTF-8, split on first use."""

    def __init__(
        self, lines: np.ndarray, images: bytes, prompts: bytes, extras: bytes, source: str
    ) -> None:
        self.lines, self.source = lines, source
        self._joined = (images, prompts, extras)

    @cached_property
    def _text(self) -> tuple[list[str], list[str], list[str]]:
        count = len(self.lines)
        columns = tuple(
            joined.decode("utf-8").split(_SEP) if count else [] for joined in self._joined
        )
        if any(len(column) != count for column in columns):
            raise ValueError(f"row columns of different lengths (expected {count})")
        return columns  # type: ignore[return-value]

    def check(self) -> None:
        """Split the text columns now: ValueError when they disagree with the line numbers."""
        _ = self._text

    def __len__(self) -> int:
        return len(self.lines)

    @overload
    def __getitem__(self, i: int) -> Row: ...
    @overload
    def __getitem__(self, i: slice) -> list[Row]: ...
    def __getitem__(self, i: int | slice) -> Row | list[Row]:
        if isinstance(i, slice):
            return [self._row(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._row(i)

    def __iter__(self) -> Iterator[Row]:
        return (self._row(i) for i in range(len(self)))

    def __getstate__(self) -> dict[str, Any]:  # to worker processes: the joined bytes only
        return {"lines": self.lines, "source": self.source, "_joined": self._joined}

    def _row(self, i: int) -> Row:
        images, prompts, extras = self._text
        fields: dict[str, Any] = json.loads(extras[i]) if extras[i] else {}
        return Row(int(self.lines[i]), images[i], prompts[i], fields, self.source)
