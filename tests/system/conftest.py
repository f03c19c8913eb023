"""System-test fixtures: real ``switchboard ingest`` / ``ack`` processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.support.db import scalar
from tests.support.oracle import assert_exactly_once
from tests.support.procs import SwitchboardProcess, wait_for

# Planted in every URL the processes get; it must never reach a log line.
SECRET = "planted-s3cret-7731"


def with_secret_db(url: str) -> str:
    # PostgreSQL here uses trust auth, so the password is carried but unused.
    return url.replace("postgres@", f"postgres:{SECRET}@", 1)


def with_secret_redis(url: str) -> str:
    # Valkey's default user is nopass: any password authenticates.
    return url.replace("redis://", f"redis://default:{SECRET}@", 1)


class Processes:
    """Starts switchboard processes for a test and reaps every one of them."""

    def __init__(self, tmp_path: Path) -> None:
        self._tmp = tmp_path
        self.all: list[SwitchboardProcess] = []

    def start(
        self, verb: str, config: Path, *, name: str, failpoints: str | None = None
    ) -> SwitchboardProcess:
        incarnation = sum(1 for p in self.all if p.log_path.name.startswith(f"{name}."))
        proc = SwitchboardProcess(
            verb,
            config,
            self._tmp / f"{name}.{incarnation}.log",
            consumer=name if verb == "ingest" else None,
            failpoints=failpoints,
        )
        self.all.append(proc)
        return proc

    def logs_text(self) -> str:
        return "".join(p.raw_log() for p in self.all)

    def assert_no_secret_logged(self) -> None:
        assert SECRET not in self.logs_text()


def wait_ready(proc: SwitchboardProcess, timeout_s: float = 30) -> None:
    """Until the process has installed its signal handlers and is working: a
    SIGTERM before the interpreter has even started our code kills it outright."""
    event = "poll_loop_started" if proc.verb == "ingest" else "listening"
    wait_for(lambda: proc.events(event), timeout_s=timeout_s, what=f"{proc.log_path.name}: {event}")


def assert_clean_exit(proc: SwitchboardProcess, code: int) -> None:
    """Exit 0 means no task or thread outlived the run (the CLI checks both);
    -X dev and -W error make unclosed resources loud."""
    text = proc.raw_log()
    assert code == 0, f"exit {code}\n{text[-3000:]}"
    for bad in ("Traceback", "Exception ignored", "ResourceWarning", "tasks_leaked", "threads_leaked"):
        assert bad not in text, f"{bad!r} in {proc.log_path}:\n{text[-3000:]}"


def assert_clean_end(db_url: str, redis_url: str, ids: list[str], *running: SwitchboardProcess) -> None:
    """SIGTERM each process (it must exit 0, clean), then the exactly-once
    oracle over the ``orders`` stream for the produced entry ids."""
    for proc in running:
        assert_clean_exit(proc, proc.terminate())
    assert_exactly_once(db_url, redis_url, stream="orders", group="switchboard", produced_ids=ids)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    p = Processes(tmp_path)
    yield p
    for proc in p.all:
        proc.ensure_dead()


def produce(redis_url: str, stream: str, n: int, start: int = 0) -> list[str]:
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        pipe = r.pipeline(transaction=False)
        for i in range(start, start + n):
            pipe.xadd(stream, {"body": f'{{"n": {i}}}'})
        return [i.decode() for i in pipe.execute()]


def xpending(redis_url: str, stream: str, group: str = "switchboard") -> int:
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        return int(r.xpending(stream, group)["pending"])


@pytest.fixture
def config_urls() -> tuple[Callable[[str], str], Callable[[str], str]]:
    """Every URL the processes get carries the planted secret."""
    return with_secret_db, with_secret_redis


def acked(db_url: str) -> int:
    """Inbox rows whose ack has been discharged."""
    return int(scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'"))


def wait_all_acked(
    db_url: str, redis_url: str, expected: int, *, timeout_s: float, what: str, stream: str = "orders"
) -> None:
    """Until ``expected`` inbox rows are acked and the stream's PEL is empty."""
    wait_for(
        lambda: acked(db_url) == expected and xpending(redis_url, stream) == 0, timeout_s=timeout_s, what=what
    )


def entries_read(redis_url: str, stream: str, group: str = "switchboard") -> int:
    """How many entries the group has delivered (XINFO GROUPS entries-read)."""
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        (info,) = [g for g in r.xinfo_groups(stream) if g["name"].decode() == group]
        return int(info["entries-read"])
