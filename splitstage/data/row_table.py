"""A data set's rows kept as columns and made into `Row` objects only when one is used: what a
rerun of 10^6 rows restores from the index memo without building a million objects (or even
splitting its text columns) up front."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any, overload

import numpy as np

from splitstage.data.dataset import Row

_SEP = "\0"


class RowTable(Sequence[Row]):
    """Rows as columns: line numbers, and image paths, prompts, extra fields (JSON text or '')
    and reference image paths (a JSON list or ''; absent: none) as NUL-joined UTF-8, split on
    first use."""

    def __init__(
        self,
        lines: np.ndarray,
        images: bytes,
        prompts: bytes,
        extras: bytes,
        source: str,
        references: bytes | None = None,
    ) -> None:
        self.lines, self.source = lines, source
        self._joined = (images, prompts, extras)
        self._references = references

    @cached_property
    def _refs(self) -> list[str] | None:
        count = len(self.lines)
        if self._references is None:
            return None
        column = self._references.decode("utf-8").split(_SEP) if count else []
        if len(column) != count:
            raise ValueError(f"row columns of different lengths (expected {count})")
        return column

    @cached_property
    def _text(self) -> tuple[list[str], list[str], list[str]]:
        count = len(self.lines)
        columns = tuple(
            joined.decode("utf-8").split(_SEP) if count else [] for joined in self._joined
        )
        if any(len(column) != count for column in columns):
            raise ValueError(f"row columns of different lengths (expected {count})")
        return columns  # type: ignore[return-value]

    def has_references(self) -> bool:
        """Whether the table holds a reference image column (rows restored without one: none)."""
        return self._references is not None

    def check(self) -> None:
        """Split the text columns now: ValueError when they disagree with the line numbers."""
        _ = self._text, self._refs

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

    def plus(self, rows: Sequence[Row]) -> RowTable | None:
        """This table with `rows` after it; None when a row's fields cannot be kept as text
        (a NUL, or extra fields JSON would not give back as they are)."""
        if not rows:
            return self
        if any(row.source != self.source for row in rows):
            return None
        extras = [extras_text(row.extras) for row in rows]
        refs = [references_text(row.references) for row in rows]
        texts = ([r.image for r in rows], [r.prompt for r in rows], extras, refs)
        if None in extras or any(_SEP in t for column in texts for t in column):
            return None
        count = len(self.lines)
        old_refs = self._references
        if old_refs is None:
            old_refs = _SEP.encode() * (count - 1) if count else b""
        joined = tuple(
            (old + _SEP.encode() if count else b"") + _SEP.join(column).encode("utf-8")
            for old, column in zip((*self._joined, old_refs), texts, strict=True)
        )
        lines = np.concatenate([self.lines, np.array([r.line for r in rows], np.int64)])
        return RowTable(lines, *joined[:3], self.source, joined[3])

    def __getstate__(self) -> dict[str, Any]:  # to worker processes: the joined bytes only
        return {
            "lines": self.lines,
            "source": self.source,
            "_joined": self._joined,
            "_references": self._references,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"_references": None, **state})

    def _row(self, i: int) -> Row:
        images, prompts, extras = self._text
        fields: dict[str, Any] = json.loads(extras[i]) if extras[i] else {}
        refs = self._refs
        references = tuple(json.loads(refs[i])) if refs is not None and refs[i] else ()
        return Row(int(self.lines[i]), images[i], prompts[i], fields, self.source, references)


def references_text(references: Sequence[str]) -> str:
    """Reference image paths as JSON text ('' for none)."""
    return json.dumps(list(references), ensure_ascii=False) if references else ""


def extras_text(extras: Mapping[str, Any]) -> str | None:
    """Extra fields as JSON text ('' for none); None when JSON would not give them back as they
    are (e.g. dates or bytes from parquet), so such rows are never kept wrongly."""
    if not extras:
        return ""
    try:
        text = json.dumps(extras, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    return text if json.loads(text) == extras else None
