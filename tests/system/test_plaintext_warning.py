"""Issue 32, item 9: a real `switchboard ingest` warns at start of a
database reached without TLS over the network (one structured line, no
password), and says nothing of loopback servers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ingest.embedded.processes import wait_for
from tests.support.config import stream_adapter
from tests.support.processes import SECRET, Processes

pytestmark = pytest.mark.system
# TEST-NET-1 (RFC 5737): an address of no host, so nothing answers there;
# the process warns before it connects, then retries until stopped.
REMOTE = "192.0.2.1"


def test_a_remote_database_without_tls_is_warned_of_at_start(
    procs: Processes, make_config: Callable[..., Path]
) -> None:
    config = make_config(stream_adapter("orders"))
    remote = procs.start(
        "ingest",
        config,
        name="ingest-remote",
        env={"SWITCHBOARD_DATABASE_URL": f"postgresql://switchboard:{SECRET}@{REMOTE}:5432/switchboard"},
    )
    local = procs.start("ingest", config, name="ingest-local")
    warned = wait_for(lambda: remote.events("plaintext_connection"), timeout_s=30, what="the warning")
    assert len(warned) == 1
    line = warned[0]
    assert line["level"] == "warning"
    assert (line["server"], line["host"], line["port"]) == ("database", REMOTE, 5432)
    assert line["used_by"] == ["SWITCHBOARD_DATABASE_URL"]
    assert line["tls"] == "sslmode=prefer"
    assert "sslmode=verify-full" in line["hint"]
    # The loopback ingester is up and said nothing of the kind.
    wait_for(lambda: local.events("poll_loop_started"), timeout_s=30, what="the local ingester's poll loop")
    assert local.events("plaintext_connection") == []
    for proc in (remote, local):
        assert proc.terminate(timeout_s=30) == 0, proc.raw_log()[-2000:]
    procs.assert_no_secret_logged()
