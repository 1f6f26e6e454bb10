"""Sample keys held compactly: one sorted fixed-width bytes array instead of a million str.

Keys that all have one even length in lowercase hex (sha256 sample keys) are packed two characters
per byte (32 bytes a key); other names are kept as ASCII padded with NUL (names never hold NUL).
Both sort as the str keys sort, so look-ups are `np.searchsorted` and the seeded epoch order is
that of `sorted(keys)`. Files are Parquet (`storage.parquet_columns`: the keys' bytes end to end,
the encoding, width and count as schema metadata, a CRC-32 on every page), never pickle.
"""

from __future__ import annotations

import binascii
import hashlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

from splitstage.splitter import UserError
from splitstage.storage.parquet_columns import ColumnFile, write_columns

FORMAT = "splitstage-keys-v2"
SUFFIX = ".parquet"  # key files' names end so
_NAME_RE = re.compile(r"^[A-Za-z0-9_=-][A-Za-z0-9_.=-]*$")  # as shard_format's sample keys


class KeyFileError(UserError, ValueError):
    """A sample-keys file is not one splitstage wrote; the message names the file and the fix."""


def _encode(keys: Sequence[str]) -> tuple[np.ndarray, bool]:
    """Keys as a fixed-width bytes array (hex-packed when every key allows it), in input order.
    Characters no name holds (non-ASCII, NUL) become '?', which no committed key holds either."""
    if not keys:
        return np.zeros(0, "S1"), False
    lengths = set(map(len, keys))
    width = max(lengths)
    if len(lengths) == 1 and width % 2 == 0 and width:
        joined = "".join(keys)
        try:
            packed = bytes.fromhex(joined)
        except ValueError:
            packed = b""
        if len(packed) * 2 == len(joined) and packed.hex() == joined:  # strictly lowercase hex
            return np.frombuffer(packed, f"S{width // 2}").copy(), True
    raw = [k.encode("ascii", "replace").replace(b"\0", b"?") for k in keys]
    return np.array(raw, f"S{max(width, 1)}"), False


def _decode(array: np.ndarray, hexed: bool) -> list[str]:
    """The str keys of an encoded array, in its order."""
    if not len(array):
        return []
    if hexed:
        text = binascii.hexlify(np.ascontiguousarray(array).tobytes()).decode("ascii")
        step = 2 * array.dtype.itemsize
        return [text[i : i + step] for i in range(0, len(text), step)]
    return [k.decode("ascii") for k in array.tolist()]


def _as_ascii(array: np.ndarray, hexed: bool, width: int) -> np.ndarray:
    """An encoded array as NUL-padded ASCII of `width` characters."""
    if hexed:
        text = binascii.hexlify(np.ascontiguousarray(array).tobytes())
        array = np.frombuffer(text, f"S{2 * array.dtype.itemsize}") if len(array) else array
    return array.astype(f"S{max(width, 1)}")


class KeyTable(Sequence[str]):
    """Sorted, distinct sample keys in one numpy array; indexing decodes a key to str."""

    __slots__ = ("array", "hexed")

    def __init__(self, array: np.ndarray, hexed: bool) -> None:
        self.array, self.hexed = array, hexed

    @classmethod
    def from_keys(cls, keys: Iterable[str] | KeyTable) -> KeyTable:
        """The sorted distinct keys of `keys` (any order, duplicates allowed)."""
        if isinstance(keys, KeyTable):
            return keys
        array, hexed = _encode(keys if isinstance(keys, Sequence) else list(keys))
        return cls(np.unique(array), hexed)

    @classmethod
    def from_sorted(cls, array: np.ndarray, hexed: bool) -> KeyTable:
        """A table over an array already sorted and distinct (not copied, not checked)."""
        return cls(array, hexed)

    @property
    def width(self) -> int:
        """Characters per key (the longest key, for ASCII tables)."""
        return self.array.dtype.itemsize * (2 if self.hexed else 1)

    @property
    def nbytes(self) -> int:
        """Bytes the keys take in memory."""
        return int(self.array.nbytes)

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> KeyTable: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return KeyTable(self.array[index], self.hexed)
        one = self.array[index : index + 1 or None]
        if len(one) != 1:
            raise IndexError(f"key {index} of a table of {len(self)}")
        return one.tobytes().hex() if self.hexed else one[0].decode("ascii")

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self.array), 65536):
            yield from _decode(self.array[start : start + 65536], self.hexed)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and bool(self.contains(KeyTable.from_keys([key]))[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyTable):
            return NotImplemented
        if len(self) != len(other):
            return False
        mine, theirs = self._common(other)
        return bool(np.array_equal(mine, theirs))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KeyTable({len(self)} keys, {'hex' if self.hexed else 'ascii'}, {self.nbytes} B)"

    def decode(self, positions: np.ndarray | Sequence[int] | None = None) -> list[str]:
        """The str keys at `positions` (all keys when None), in that order."""
        array = self.array if positions is None else self.array[np.asarray(positions, np.int64)]
        return _decode(array, self.hexed)

    def to_list(self) -> list[str]:
        """Every key as str, sorted."""
        return _decode(self.array, self.hexed)

    def _common(self, other: KeyTable) -> tuple[np.ndarray, np.ndarray]:
        """Both arrays in one encoding, so they compare as their str keys compare."""
        same = self.array.dtype == other.array.dtype
        if self.hexed == other.hexed and same:
            return self.array, other.array
        width = max(self.width, other.width)
        return _as_ascii(self.array, self.hexed, width), _as_ascii(other.array, other.hexed, width)

    def positions(self, other: Iterable[str] | KeyTable) -> tuple[np.ndarray, np.ndarray]:
        """For each key of `other` (a KeyTable, or str keys in any order): its position in this
        table and whether it is here at all (position meaningless where not)."""
        if not isinstance(other, KeyTable):
            keys = other if isinstance(other, Sequence) else list(other)
            other = KeyTable(*_encode(keys))
        if not len(self) or not len(other):
            return np.zeros(len(other), np.int64), np.zeros(len(other), bool)
        mine, theirs = self._common(other)
        if len(mine) == len(theirs) and np.array_equal(mine, theirs):
            return np.arange(len(mine)), np.ones(len(mine), bool)
        pos = np.minimum(np.searchsorted(mine, theirs), len(mine) - 1)
        return pos, mine[pos] == theirs

    def contains(self, other: Iterable[str] | KeyTable) -> np.ndarray:
        """Boolean mask over `other`'s keys: which are in this table."""
        return self.positions(other)[1]

    def select(self, mask: np.ndarray) -> KeyTable:
        """The keys where `mask` is true (still sorted and distinct)."""
        return KeyTable(self.array[mask], self.hexed)

    def without(self, other: Iterable[str] | KeyTable) -> KeyTable:
        """This table minus the keys of `other`."""
        other = KeyTable.from_keys(other)
        return self if not len(other) else self.select(~other.contains(self))

    def json_hash(self) -> str:
        """sha256 of the keys as a compact JSON list: `fingerprint.stable_hash(list(self))`
        without a million str (names need no JSON escapes)."""
        if not len(self):
            return hashlib.sha256(b"[]").hexdigest()
        text = np.frombuffer(_as_ascii(self.array, self.hexed, self.width).tobytes(), np.uint8)
        rows = text.reshape(len(self), self.width)
        framed = np.full((len(self), self.width + 3), ord('"'), np.uint8)
        framed[:, 1 : self.width + 1] = rows
        framed[:, -1] = ord(",")
        flat = framed.reshape(-1)
        if not self.hexed:  # drop the NUL padding of shorter keys
            flat = flat[flat != 0]
        return hashlib.sha256(b"[" + flat[:-1].tobytes() + b"]").hexdigest()

    # ---- files -----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The table as Parquet bytes: its keys' bytes end to end, encoding, width and count."""
        rows = np.frombuffer(np.ascontiguousarray(self.array).tobytes(), np.uint8)
        meta = {
            "format": FORMAT,
            "encoding": "hex" if self.hexed else "ascii",
            "width": str(self.array.dtype.itemsize),
            "count": str(len(self)),
        }
        return write_columns({"keys": rows}, meta)

    def save(self, path: str | os.PathLike) -> None:
        """Write the table to a local file atomically (temporary file, then rename)."""
        tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
        with open(tmp, "wb") as out:
            out.write(self.to_bytes())
        os.replace(tmp, path)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> KeyTable:
        """Parse and check `to_bytes` output; KeyFileError naming `where` if it is not one."""
        fix = f"{where} is not a splitstage sample-keys file"
        again = "rerun the command that wrote it (`splitstage preprocess` writes the cache's)"
        try:
            rows, meta = _parquet(data)
        except Exception as exc:  # any parse failure is a bad file
            raise KeyFileError(f"{fix} ({type(exc).__name__}: {exc}); {again}") from None
        if (
            not isinstance(meta, dict)
            or meta.get("format") != FORMAT
            or meta.get("encoding") not in ("hex", "ascii")
        ):
            raise KeyFileError(f"{fix} (format {meta!r}); {again}")
        if rows.dtype != np.uint8 or rows.ndim != 2 or (len(rows) and not rows.shape[1]):
            raise KeyFileError(f"{fix} (keys {rows.dtype} {list(rows.shape)}); {again}")
        width = f"S{max(rows.shape[1], 1)}"
        table = cls(np.frombuffer(rows.tobytes(), width), meta["encoding"] == "hex")
        if len(table) > 1 and not bool(np.all(table.array[1:] > table.array[:-1])):
            raise KeyFileError(f"{fix}: its keys are not sorted and distinct; {again}")
        if not table.hexed and not all(_NAME_RE.match(k) for k in table):
            raise KeyFileError(f"{fix}: it holds a key that is not a sample key; {again}")
        return table

    @classmethod
    def load(cls, path: str | os.PathLike) -> KeyTable:
        """Read a file written by `save`."""
        with open(path, "rb") as src:
            return cls.from_bytes(src.read(), os.fspath(path))


def _parquet(data: bytes) -> tuple[np.ndarray, dict]:
    """A Parquet key file's keys as uint8 [N, width] and its metadata (a flipped byte raises)."""
    file = ColumnFile(data)
    meta = file.meta
    if meta.get("format") != FORMAT:
        return np.zeros((0, 1), np.uint8), meta  # the caller refuses it for its format
    keys, width, count = file.columns()["keys"], int(meta["width"]), int(meta["count"])
    if width < 1 or len(keys) != width * count:
        raise ValueError(f"{len(keys)} bytes of keys for {count} keys of {width}")
    return keys.reshape(count, width), meta
