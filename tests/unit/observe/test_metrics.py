"""The metric definitions, the /healthz verdict and the Grafana dashboard
in ops/ (which must use exactly the metric names the processes export)."""

from __future__ import annotations

import json
import re
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from backhalf import metrics
from ingest.embedded.processes import wait_for
from ingest.observe.metrics_http import Liveness, MetricsServer

DASHBOARD = Path(__file__).parents[3] / "ops" / "grafana-dashboard.json"


def exported_names() -> dict[str, str]:
    """Every Switchboard metric's exported name -> its type."""
    names = {}
    for value in vars(metrics).values():
        if hasattr(value, "_name") and hasattr(value, "_type") and value._name.startswith("switchboard_"):
            suffix = "_total" if value._type == "counter" else ""
            names[value._name + suffix] = value._type
    return names


def test_names_follow_prometheus_conventions() -> None:
    names = exported_names()
    assert len(names) >= 25
    for name, kind in names.items():
        assert re.fullmatch(r"switchboard_[a-z_]+", name), name
        assert name.endswith("_total") == (kind == "counter"), name
        if "_duration" in name or "_age" in name:
            assert name.endswith("_seconds"), name


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        ("invalid_json: Expecting value", "invalid_json"),
        ("too_large: 5 bytes exceeds max_message_bytes=1", "too_large"),
        ("lost_before_ingest: the entry was deleted", "lost_before_ingest"),
        ("Some Text: with capitals", "other"),
        ("no colon at all but long enough to pass forty characters in all", "other"),
        ("", "other"),
    ],
)
def test_a_rejection_reason_is_a_bounded_token(error: str, reason: str) -> None:
    assert metrics.reason_of(error) == reason


def test_the_error_class_is_the_root_cause() -> None:
    outer = RuntimeError("wrapped")
    outer.__cause__ = ConnectionRefusedError("no")
    assert metrics.error_class(outer) == "ConnectionRefusedError"
    assert metrics.error_class(ValueError("alone")) == "ValueError"


def test_liveness_is_unhealthy_until_the_database_answers_and_while_a_loop_is_stuck() -> None:
    live = Liveness(database_stale_s=60)
    fresh = live.watch("poll:orders", stale_after_s=60)
    ok, body = live.report()
    assert not ok
    assert body["database"] == {"ok": False, "since_answer_s": None}
    live.database_answered()
    fresh()
    ok, body = live.report()
    assert ok, body
    live.watch("drain", stale_after_s=-1.0)  # a bound already passed: stuck
    ok, body = live.report()
    assert not ok
    assert body["loops"]["drain"]["ok"] is False
    assert body["loops"]["poll:orders"]["ok"] is True
    live.forget("drain")
    live.database_failed("OperationalError")
    ok, body = live.report()
    assert ok  # answered recently; the error is shown
    assert body["database"]["last_error"] == "OperationalError"


def test_the_endpoint_serves_metrics_and_health_and_stops_cleanly() -> None:
    registry = CollectorRegistry()
    Counter("demo_things", "Things.", registry=registry).inc(3)
    verdict: list[tuple[bool, dict[str, object]]] = [(True, {"status": "ok"})]
    server = MetricsServer("127.0.0.1", 0, lambda: verdict[0], registry)
    try:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as reply:
            families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
        assert families["demo_things"].samples[0].value == 3
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as reply:
            assert (reply.status, json.loads(reply.read())) == (200, {"status": "ok"})
        verdict[0] = (False, {"status": "unhealthy"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"{base}/healthz", timeout=5)
        assert caught.value.code == 503
        caught.value.close()
    finally:
        server.close()


def _dashboard_names() -> set[str]:
    exprs = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", [])]
    found = set()
    for expr in exprs:
        found |= set(re.findall(r"switchboard_[a-z_]+", expr))
    return found


def test_the_grafana_dashboard_uses_exactly_the_exported_names() -> None:
    names = exported_names()
    histograms = {n for n, kind in names.items() if kind == "histogram"}
    allowed = set(names) | {f"{h}_{s}" for h in histograms for s in ("bucket", "sum", "count")}
    used = _dashboard_names()
    assert used <= allowed, used - allowed
    # Every metric has a panel: a histogram through any of its series.
    shown = {n for n in used if n in names} | {h for h in histograms if any(u.startswith(h) for u in used)}
    assert shown == set(names), set(names) - shown


def test_an_idle_client_cannot_hold_the_endpoint_open_at_close() -> None:
    """A client that connects and sends nothing is dropped after the request
    timeout: close() returns and leaves no request thread behind (it used to
    wait for that client forever, and so did the process's stop)."""
    server = MetricsServer("127.0.0.1", 0, lambda: (True, {}), CollectorRegistry())
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as idle:
        wait_for(lambda: _request_threads() == 1, timeout_s=5, what="the idle client's thread")
        server.close()
        assert _request_threads() == 0
        assert idle.recv(1) == b""  # the server hung up on it


def _request_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "metrics-http-request")


def test_a_workers_graceful_stop_waits_for_its_longest_time_limit() -> None:
    """dramatiq abandons running handlers after its shutdown timeout (ten
    minutes by default): a queue allowed longer runs must be waited for."""
    from ingest.config import from_mapping
    from ingest.processes.workers.worker import DRAMATIQ_SHUTDOWN_TIMEOUT_MS, shutdown_timeout_ms

    queues = {"short": {"handler": "m:f"}, "long": {"handler": "m:g", "time_limit_ms": 3_600_000}}
    settings = from_mapping({"database": {"url": "postgresql://u@h/d"}, "queues": queues}, {})
    assert shutdown_timeout_ms(settings, ["short"]) == DRAMATIQ_SHUTDOWN_TIMEOUT_MS + 2_000
    assert shutdown_timeout_ms(settings, ["short", "long"]) > 3_600_000
