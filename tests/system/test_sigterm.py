"""SIGTERM to real processes: mid-stream, while blocked in XREADGROUP, and while a
store transaction is open; each exits 0 and leaves what it had not stored for
redelivery."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from ingest.embedded.processes import wait_for, wait_ready
from ingest.exit_codes import EXIT_FORCED, EXIT_OK
from tests.support.config import stream_adapter
from tests.support.db import libpq, scalar
from tests.support.oracle import assert_clean_end, wait_all_acked
from tests.support.processes import Processes, assert_clean_exit
from tests.support.streams import produce, xpending

pytestmark = pytest.mark.system
STREAM = "orders"


def test_sigterm_mid_stream_exits_0_and_leaves_in_flight_for_redelivery(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter(STREAM, batch_size=20))
    ids = produce(redis_url, STREAM, 2000)
    ingester = procs.start("ingest", config, name="ingester-1")
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM todos") > 0, timeout_s=30, what="first todos")
    assert_clean_exit(ingester, ingester.terminate(timeout_s=15))
    stored = scalar(db_url, "SELECT count(*) FROM inbox")
    assert 0 < stored < 2000, "stopped mid-stream"
    # Nothing was acked (no acker ran); every delivered entry is still pending,
    # including any read whose store was abandoned.
    assert xpending(redis_url, STREAM) >= stored
    assert ingester.events("ingester_stopped")
    acker = procs.start("ack", config, name="acker-1")
    restarted = procs.start("ingest", config, name="ingester-1")
    wait_all_acked(
        db_url, redis_url, 2000, timeout_s=60, what="everything stored and acked after the restart"
    )
    assert_clean_end(db_url, redis_url, ids, restarted, acker)


def test_sigterm_while_blocked_in_xreadgroup_exits_promptly(
    procs: Processes, make_config: Callable[..., Path], db_url: str
) -> None:
    config = make_config(stream_adapter(STREAM, block_ms=30_000))
    ingester = procs.start("ingest", config, name="ingester-1")
    acker = procs.start("ack", config, name="acker-1")
    wait_for(lambda: ingester.events("poll_loop_started"), timeout_s=30, what="the poll loop")
    wait_for(lambda: acker.events("listening"), timeout_s=30, what="the acker's LISTEN")
    for p in (ingester, acker):
        p.signal(signal.SIGTERM)
    # Well inside the 30 s block: the read is abandoned, not waited out.
    assert_clean_exit(ingester, ingester.wait(timeout_s=10))
    assert_clean_exit(acker, acker.wait(timeout_s=10))


def test_sigterm_while_a_store_transaction_is_open_exits_0_with_nothing_half_done(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str
) -> None:
    config = make_config(stream_adapter(STREAM, batch_size=20), ingest={"shutdown_timeout_s": 2})
    ids = produce(redis_url, STREAM, 100)
    with psycopg.connect(libpq(db_url)) as blocker:
        # Another session holds the todos table: the ingester's store starts,
        # writes what it can, and waits inside its open transaction.
        blocker.execute("LOCK TABLE todos IN ACCESS EXCLUSIVE MODE")
        ingester = procs.start("ingest", config, name="ingester-1")
        wait_for(
            lambda: scalar(
                db_url,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'switchboard'"
                " AND wait_event_type = 'Lock'",
            ),
            timeout_s=30,
            what="the store to block inside its transaction",
        )
        ingester.signal(signal.SIGTERM)
        code = ingester.wait(timeout_s=15)  # the shutdown deadline cancels the blocked store
        blocker.rollback()
    assert_clean_exit(ingester, code)
    assert ingester.events("shutdown_deadline_exceeded")
    for table in ("inbox", "events", "todos"):
        assert scalar(db_url, f"SELECT count(*) FROM {table}") == 0
    assert xpending(redis_url, STREAM) > 0  # read, not stored, not acked: pending for redelivery
    acker = procs.start("ack", config, name="acker-1")
    restarted = procs.start("ingest", config, name="ingester-1")
    wait_all_acked(db_url, redis_url, 100, timeout_s=60, what="redelivery after the restart")
    assert_clean_end(db_url, redis_url, ids, restarted, acker)


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for the signal (its SigCgt mask),
    False once it is gone. An interpreter that has begun finalizing no longer
    has one: its handlers went back to the default action, or are ignored."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & (1 << (signum - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status")
@pytest.mark.parametrize(
    ("verb", "stopped", "signum"),
    [
        ("ingest", "ingester_stopped", signal.SIGTERM),
        ("ingest", "ingester_stopped", signal.SIGINT),
        ("ack", "acker_stopped", signal.SIGTERM),
        ("ack", "acker_stopped", signal.SIGINT),
    ],
    ids=["ingest-SIGTERM", "ingest-SIGINT", "ack-SIGTERM", "ack-SIGINT"],
)
def test_a_second_stop_signal_after_the_graceful_stop_exits_0_or_130_not_by_the_signal(
    procs: Processes, make_config: Callable[..., Path], verb: str, stopped: str, signum: signal.Signals
) -> None:
    """Issue 23, as a supervisor did it: stop, see the stopped line, send the
    same signal again: the process died by it (exit -15 or -2), 4 times in 4.

    After the stopped line the interpreter finalizes for about a second,
    having put back the default action of every signal it handled. The
    second signal is sent as soon as the process no longer catches it (or
    has exited): the start of that stretch, where a plain "wait for the line,
    signal" lands nearly always too."""
    proc = procs.start(verb, make_config(stream_adapter(STREAM)), name=f"{verb}-1")
    wait_ready(proc)
    proc.signal(signum)
    wait_for(lambda: proc.events(stopped), timeout_s=15, what=stopped)
    wait_for(
        lambda: not _catches(proc.pid, signum),
        timeout_s=15,
        what=f"{verb} to stop catching {signum.name} (finalizing) or exit",
        interval_s=0.001,
    )
    if proc.alive():
        proc.signal(signum)
    code = proc.wait(timeout_s=15)
    assert code in (EXIT_OK, EXIT_FORCED), f"{verb} exited {code} after a second {signum.name}"
    assert proc.events(stopped)
