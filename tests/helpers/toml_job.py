"""A job dict written as the TOML file the CLI reads (tables, arrays of tables, plain values)."""

from __future__ import annotations

import json


def toml(document: dict, prefix: str = "", header: str | None = None) -> str:
    """`document` as TOML: nested dicts become [tables], lists of dicts [[arrays of tables]]."""
    lines, tables = [], []
    for key, value in document.items():
        if isinstance(value, dict):
            tables.append(toml(value, f"{prefix}{key}."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for item in value:
                tables.append(toml(item, f"{prefix}{key}.", f"[[{prefix}{key}]]\n"))
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    if header is None:
        header = f"[{prefix[:-1]}]\n" if prefix and lines else ""
    return header + "".join(f"{line}\n" for line in lines) + "".join(tables)
