"""Config files in the contract's TOML form, written from plain mappings: for
the demo, the tests and the benchmarks."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(item) for item in v) + "]"
    return json.dumps(str(v))  # a JSON string of ASCII/escapes is a TOML basic string


def _table(values: Mapping[str, Any]) -> str:
    return "".join(f"{k} = {_value(v)}\n" for k, v in values.items())


def write_config(
    path: Path,
    *,
    database_url: str,
    adapters: list[Mapping[str, Any]],
    redis_url: str | None = None,
    database: Mapping[str, Any] | None = None,
    ingest: Mapping[str, Any] | None = None,
    acker: Mapping[str, Any] | None = None,
    queues: Mapping[str, Mapping[str, Any]] | None = None,
    worker: Mapping[str, Any] | None = None,
    receiver: Mapping[str, Any] | None = None,
) -> Path:
    """``[database]`` (its url and ``database``), ``[redis]`` when ``redis_url`` is
    given, one ``[[adapters]]`` table each, ``[ingest]`` / ``[acker]`` when
    given, one ``[queues.NAME]`` table each, and ``[worker]`` and ``[receiver]``
    when given."""
    text = f"[database]\n{_table({'url': database_url, **(database or {})})}"
    if redis_url is not None:
        text += f"\n[redis]\n{_table({'url': redis_url})}"
    for a in adapters:
        text += f"\n[[adapters]]\n{_table(a)}"
    if ingest is not None:
        text += f"\n[ingest]\n{_table(ingest)}"
    if acker is not None:
        text += f"\n[acker]\n{_table(acker)}"
    for name, queue in (queues or {}).items():
        text += f"\n[queues.{name}]\n{_table(queue)}"
    if worker is not None:
        text += f"\n[worker]\n{_table(worker)}"
    if receiver is not None:
        text += f"\n[receiver]\n{_table(receiver)}"
    # The URLs hold the servers' passwords: the file is its owner's alone
    # (under root a temp_base is traversable by others; see servers.py).
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)
    path.chmod(0o600)  # an existing file keeps its mode through O_CREAT
    return path
