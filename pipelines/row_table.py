"""A data set's rows kept as columns and made into `Row` objects only when one is used: what a
rerun of 10^6 rows restores from the index memo without building a million objects up front."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, overload

from splitstage.pipelines.data import Row


class RowTable(Sequence[Row]):
    """Rows as columns (line numbers, image paths, prompts, extra fields as JSON text or '')."""

    def __init__(
        self,
        lines: Sequence[int],
        images: Sequence[str],
        prompts: Sequence[str],
        extras: Sequence[str],
        source: str,
    ) -> None:
        if not len(lines) == len(images) == len(prompts) == len(extras):
            raise ValueError("row columns of different lengths")
        self.lines, self.images, self.prompts, self.extras = lines, images, prompts, extras
        self.source = source

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

    def _row(self, i: int) -> Row:
        extras: dict[str, Any] = json.loads(self.extras[i]) if self.extras[i] else {}
        return Row(int(self.lines[i]), self.images[i], self.prompts[i], extras, self.source)
