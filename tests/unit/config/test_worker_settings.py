"""``[worker]`` and the relay's retired keys (DESIGN.md section 7b): a config
written for the dramatiq relay still loads, each of its keys named once in
``Settings.notices``; ``[worker]`` has its defaults and bounds; anything else
in a ``[dramatiq]`` table is still an error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ingest.config import RETIRED_KEYS, WorkerSettings, from_mapping, load
from ingest.errors import ConfigError

DB = {"url": "postgresql://sb@localhost/sb"}

# A config of the relay's days, every retired key set (some to values the
# relay itself would have refused: nothing of them is read any more).
RELAY_CONFIG = """\
[database]
url = "postgresql://sb@localhost/sb"

[dramatiq]
url = "redis://dq.internal:6379/1"
username_env = "DQ_USER"
password_env = "DQ_PASSWORD"
idle_poll_ms = 0

[acker]
batch_size = 200
dispatch_batch_size = 500
dispatch_timeout_ms = 300000

[queues.orders]
handler = "myapp.handlers:handle_order"
max_attempts = 3
lease_margin_ms = 1999
dramatiq_queue = "orders.DQ"
"""


def test_a_config_with_the_relays_keys_loads_and_names_each_one(tmp_path: Path) -> None:
    path = tmp_path / "switchboard.toml"
    path.write_text(RELAY_CONFIG, encoding="utf-8")
    settings = load(path, {})  # DQ_USER and DQ_PASSWORD unset: never looked up
    named = [
        ("[dramatiq]", "url"),
        ("[dramatiq]", "username_env"),
        ("[dramatiq]", "password_env"),
        ("[dramatiq]", "idle_poll_ms"),
        ("[acker]", "dispatch_batch_size"),
        ("[acker]", "dispatch_timeout_ms"),
        ("[queues.orders]", "lease_margin_ms"),
        ("[queues.orders]", "dramatiq_queue"),
    ]
    assert [n.partition(" is no longer used and is ignored: ")[0] for n in settings.notices] == [
        f"{where}: key {key!r}" for where, key in named
    ]
    assert settings.notices[0] == (
        "[dramatiq]: key 'url' is no longer used and is ignored: the workers take their todos from"
        " PostgreSQL, with no relay and no dramatiq Redis"
    )
    assert settings.notices[6] == (
        "[queues.orders]: key 'lease_margin_ms' is no longer used and is ignored: a claim's lease is"
        " [worker] lease_ms, extended while its worker lives"
    )
    # Every key RETIRED_KEYS knows was met once; what is kept is read as before.
    assert len(settings.notices) == len(RETIRED_KEYS)
    assert settings.acker.batch_size == 200
    assert settings.queues["orders"].max_attempts == 3
    assert settings.worker == WorkerSettings()
    # No value of the retired keys (their broker's host, its user's variables)
    # is kept anywhere in the settings.
    assert "dq.internal" not in repr(settings)


def test_a_config_without_retired_keys_has_no_notice() -> None:
    settings = from_mapping({"database": DB, "queues": {"q": {"handler": "m:f"}}}, {})
    assert settings.notices == ()


def test_an_empty_dramatiq_table_is_no_error_and_no_notice() -> None:
    assert from_mapping({"database": DB, "dramatiq": {}}, {}).notices == ()


@pytest.mark.parametrize(
    "dramatiq",
    [{"bogus": 1}, {"url": "redis://dq/1", "bogus": 1}, {"broker": "redis://dq/1"}],
)
def test_a_key_of_dramatiq_that_is_not_a_retired_one_is_still_an_error(dramatiq: dict[str, Any]) -> None:
    """Only the relay's own keys are forgiven: a misspelt or invented key in
    [dramatiq] is refused at load, as in every other table."""
    unknown = next(k for k in dramatiq if ("dramatiq", k) not in RETIRED_KEYS)
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "dramatiq": dramatiq}, {})
    assert str(info.value).startswith(f"[dramatiq]: unknown key {unknown!r}")


@pytest.mark.parametrize("value", [5, "redis://dq/1", True])
def test_a_dramatiq_that_is_no_table_is_refused_as_every_other_table_is(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "dramatiq": value}, {})
    assert str(info.value) == "[dramatiq]: must be a table"


def test_a_retired_key_in_another_table_is_still_unknown() -> None:
    """The relay's keys are forgiven in their own tables only."""
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "acker": {"lease_margin_ms": 30_000}}, {})
    assert str(info.value).startswith("[acker]: unknown key 'lease_margin_ms'")


def test_worker_defaults() -> None:
    worker = from_mapping({"database": DB}, {}).worker
    assert (worker.lease_ms, worker.poll_interval_ms) == (30_000, 1_000)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"lease_ms": 3_000}, (3_000, 1_000)),
        ({"lease_ms": 600_000, "poll_interval_ms": 1}, (600_000, 1)),
        ({"poll_interval_ms": 1_000}, (30_000, 1_000)),
    ],
)
def test_worker_bounds_are_inclusive(raw: dict[str, int], expected: tuple[int, int]) -> None:
    worker = from_mapping({"database": DB, "worker": raw}, {}).worker
    assert (worker.lease_ms, worker.poll_interval_ms) == expected


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"poll_interval_ms": 1_001}, "[worker]: key 'poll_interval_ms' must be at most 1000"),
        ({"poll_interval_ms": 0}, "[worker]: key 'poll_interval_ms': must be an integer >= 1 (got 0)"),
        ({"lease_ms": 2_999}, "[worker]: key 'lease_ms': must be an integer >= 3000 (got 2999)"),
        ({"lease_ms": "30000"}, "[worker]: key 'lease_ms': must be an integer >= 3000 (got '30000')"),
        ({"lease_ms": True}, "[worker]: key 'lease_ms': must be an integer >= 3000 (got True)"),
    ],
)
def test_worker_values_out_of_bounds_are_refused(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"database": DB, "worker": raw}, {})
    assert str(info.value) == message
