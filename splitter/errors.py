"""Errors raised by the splitter: each names the unit, param or model at fault and the fix."""

from __future__ import annotations

import difflib


class UserError(Exception):
    """Bad input from a user (config, data, graph, storage): the CLI prints one line, exits 2."""


class SplitterError(UserError, ValueError):
    """Base of every splitter error."""


class PipelineSpecError(SplitterError):
    """A pipeline or unit record is malformed (wrong type, unknown field, duplicate name)."""


class UnknownModelError(SplitterError):
    """A trainable model is used by no unit and no in-iteration model of the pipeline."""


class StageAssignmentError(SplitterError):
    """A pipeline-parallel stage assignment is impossible or a given one is invalid."""


def closest(name: str, candidates) -> str | None:
    """Return the candidate most similar to `name`, or None when nothing is close."""
    matches = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates) -> str:
    """Return ' Did you mean X?' for the closest candidate, or an empty string."""
    match = closest(name, candidates)
    return f" Did you mean '{match}'?" if match else ""
