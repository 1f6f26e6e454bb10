"""The cache's error types: each names the file or key at fault and the fix (exit 2 in the CLI)."""

from __future__ import annotations

from splitstage.splitter import UserError


class CacheCorruptError(UserError, RuntimeError):
    """A shard or index entry is damaged or missing; the message names the file and the fix."""


class CacheNotFoundError(UserError, FileNotFoundError):
    """The cache (its folder, its bucket or the cache-key folder under it) does not exist."""


class SampleNotCachedError(UserError, KeyError):
    """Asked for sample keys that have no committed index entry."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
