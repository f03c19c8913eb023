"""The runtime disable flag: a disabled adapter consumes nothing until it is
enabled again through the CLI."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from ingest.embedded.processes import wait_for
from tests.support.config import stream_adapter
from tests.support.db import scalar
from tests.support.oracle import assert_clean_end
from tests.support.processes import Processes, switchboard
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system
STREAM = "orders"


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return switchboard("--config", str(config), *args)


def test_disabled_adapter_does_not_consume_until_enabled(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter(STREAM))
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_for(lambda: ingester.events("poll_loop_started"), timeout_s=30, what="the poll loop")
    assert _cli(config, "adapters", "disable", "orders").returncode == 0
    wait_for(lambda: ingester.events("adapter_disabled"), timeout_s=30, what="the flag to be seen")
    ids = produce(redis_url, STREAM, 50)
    # An observation window of many refresh periods (200 ms): no read at all.
    with pytest.raises(AssertionError, match="timed out"):
        wait_for(lambda: xpending(redis_url, STREAM) > 0, timeout_s=1.5, what="any consumption")
    assert scalar(db_url, "SELECT count(*) FROM inbox") == 0
    listing = _cli(config, "adapters", "list")
    assert "orders" in listing.stdout
    assert "disabled" in listing.stdout
    assert _cli(config, "adapters", "enable", "orders").returncode == 0
    wait_for(
        lambda: scalar(db_url, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'") == 50,
        timeout_s=30,
        what="consumption after enable",
    )
    assert ingester.events("adapter_enabled")
    assert_clean_end(db_url, redis_url, ids, ingester, acker)
