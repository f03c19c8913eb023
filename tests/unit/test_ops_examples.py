"""The shipped ops examples as written: the example config starts the
ingester with no warning, and the ACL file is users only and grants the
config's sources (loaded for real: tests/system/test_ops_examples.py)."""

from __future__ import annotations

from pathlib import Path

import structlog

from backhalf.db import MAX_OVERFLOW
from ingest.adapters.factory import transport
from ingest.config import load
from ingest.processes.pull.ingester import connections_needed, warn_if_pool_small
from tests.support.acl import ACL_USERS

EXAMPLE_CONFIG = Path(__file__).parents[2] / "ops" / "switchboard.example.toml"


class _Adapter:
    """What the pool check reads of an adapter: its mode's class attribute."""

    def __init__(self, overlapping_commits: bool) -> None:
        self.overlapping_commits = overlapping_commits


def test_the_example_config_gives_the_ingester_the_pool_its_adapters_need() -> None:
    settings = load(EXAMPLE_CONFIG, {})
    adapters = [
        _Adapter(transport(a.transport).MODES[a.mode].adapter.overlapping_commits)  # type: ignore[attr-defined]
        for a in settings.adapters
    ]
    assert sorted(a.mode for a in settings.adapters) == ["list", "pubsub", "stream"]
    needed = connections_needed(adapters, settings.ingest.commits_in_flight)  # type: ignore[arg-type]
    assert needed <= settings.database.pool_size + MAX_OVERFLOW
    with structlog.testing.capture_logs() as logged:
        warn_if_pool_small(adapters, settings)  # type: ignore[arg-type]
    assert [e for e in logged if e["event"] == "pool_smaller_than_needed"] == []


def test_the_acl_file_is_user_lines_only_and_grants_the_example_configs_sources() -> None:
    """An aclfile may hold nothing but ``user`` lines (and blank ones): Redis 7
    and Valkey 9 refuse to start on a comment."""
    lines = [line for line in ACL_USERS.read_text().splitlines() if line.strip()]
    assert all(line.startswith("user ") for line in lines), lines
    users = {line.split()[1]: line.split()[2:] for line in lines}
    for adapter in load(EXAMPLE_CONFIG, {}).adapters:
        rules = users[f"switchboard-{adapter.mode}"]
        if adapter.mode == "pubsub":
            assert f"&{adapter.source}" in rules
            assert "resetkeys" in rules
        else:
            assert f"~{adapter.source}" in rules
            assert "resetchannels" in rules


def test_the_acl_file_gives_the_default_user_a_password() -> None:
    """Loading an aclfile without a ``user default`` line resets the default
    user to ``nopass ~* &* +@all`` and Valkey ignores ``requirepass``: the
    shipped file would open a protected server to anyone."""
    (line,) = [x for x in ACL_USERS.read_text().splitlines() if x.startswith("user default ")]
    rules = line.split()[2:]
    assert "nopass" not in rules
    assert ">CHANGE-ME" in rules or "off" in rules
