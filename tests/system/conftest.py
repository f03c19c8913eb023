"""System-test fixtures: real ``switchboard ingest`` / ``ack`` processes
(helpers in ``tests/support/processes.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import handlers
from tests.support.db import libpq
from tests.support.processes import Processes, with_secret_db, with_secret_redis


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    p = Processes(tmp_path)
    yield p
    p.kill_all()


@pytest.fixture
def config_urls() -> tuple[Callable[[str], str], Callable[[str], str]]:
    """Every URL the processes get carries the planted secret."""
    return with_secret_db, with_secret_redis


@pytest.fixture
def runs_db(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``handler_runs`` in the test database, which the workers' handlers reach
    through the environment they inherit."""
    url = libpq(db_url)
    handlers.create_runs_table(url)
    monkeypatch.setenv(handlers.DB_VARIABLE, url)
    return url
