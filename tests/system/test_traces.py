"""One trace from the producer to the handler (issue 47, DESIGN.md section
14), through real processes and a real OTLP/HTTP collector on loopback
(``ingest.embedded.otlp_collector``, which decodes what the exporters send).

For every transport, a producer sends three messages with the broker's own
carrier of W3C trace context (a stream field, a NATS or AMQP header, an SQS
message attribute): one with the producer's ``traceparent``, whose first
run fails and second succeeds; one with a malformed ``traceparent``; one
with none. Real ``switchboard ingest`` and ``switchboard worker`` processes
run with only the ``OTEL_*`` variables set. Then:

* both runs of the first message (the retry's too) are ``switchboard run``
  spans, children of the producer's span, in its trace, with the todo's id,
  queue, attempt and outcome; the handler's own span is each run's child;
  the ``switchboard ingest`` span of its batch links to the producer's;
* the malformed context changes nothing else: its message is stored and
  done as the others, its todo keeps no context, its run starts a trace of
  its own, and the ingester says so once;
* what PostgreSQL keeps is the producer's context, in ``todos.trace_context``.

A webhook's delivery is a ``switchboard receive`` span, a child of the
sender's ``traceparent`` header, and its todo's run the receive span's
child. With no ``OTEL_*`` variable, a message's context is not even kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
import redis
from nats.aio.client import Client as Nats

from ingest.embedded.otlp_collector import Collector, Span
from ingest.embedded.processes import SwitchboardProcess, wait_for, wait_ready
from ingest.embedded.sqs_server import client_env
from tests.support import amqp, nats, sqs
from tests.support.db import query, scalar
from tests.support.downstream import FAST_RESCUE, SHORT_LEASE, stop_all
from tests.support.processes import Processes, switchboard
from tests.support.webhooks import STANDARD_SECRET, post, receiver_config, standard_headers, wait_listening

pytestmark = pytest.mark.system

QUEUE = "traced"
HANDLER = {"handler": "tests.support.handlers:traced", "max_attempts": 3, "min_backoff_ms": 50,
           "max_backoff_ms": 100}  # fmt: skip
SPANS_TIMEOUT_S = 60.0
MALFORMED = "00-not-a-trace-context"
# OTLP's span kinds.
SERVER, CONSUMER = 2, 5


def producer_context() -> tuple[str, str, str]:
    """A producer's span: (trace id, span id, its traceparent)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


class Source:
    """One transport's side: its adapter table, and a producer that sets
    the trace context where that broker carries it."""

    name = ""

    def __init__(self, url: str) -> None:
        self.url = url
        self.source = f"traced{uuid.uuid4().hex[:8]}"

    def adapter(self) -> dict[str, Any]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return {}

    def send(self, body: bytes, traceparent: str | None) -> None:
        raise NotImplementedError


class RedisStream(Source):
    name = "redis-stream"

    def adapter(self) -> dict[str, Any]:
        return {"name": "orders", "transport": "redis", "mode": "stream", "source": self.source,
                "group": "switchboard", "queue": QUEUE, "block_ms": 100, "url": self.url}  # fmt: skip

    def send(self, body: bytes, traceparent: str | None) -> None:
        fields = {"body": body} | ({"traceparent": traceparent} if traceparent else {})
        with redis.Redis.from_url(self.url, socket_timeout=10) as r:
            r.xadd(self.source, fields)


class NatsJetStream(Source):
    name = "nats-jetstream"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.stream = self.source.upper()
        nats.create_stream(url, self.stream)

    def adapter(self) -> dict[str, Any]:
        return nats.adapter_table(self.url, source=self.stream, queue=QUEUE)

    def send(self, body: bytes, traceparent: str | None) -> None:
        async def run() -> None:
            client = Nats()
            await client.connect(self.url, connect_timeout=10, max_reconnect_attempts=0)
            try:
                headers = {"traceparent": traceparent} if traceparent else None
                await client.jetstream(timeout=10).publish(f"{self.stream}.new", body, headers=headers)
            finally:
                await client.close()

        asyncio.run(run())


class Sqs(Source):
    name = "sqs"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.client = sqs.client(url)
        self.queue_url = sqs.create_queue(self.client, self.source)

    def adapter(self) -> dict[str, Any]:
        return {"name": "orders", "transport": "sqs", "source": self.source, "queue": QUEUE, "url": self.url,
                "region": sqs.REGION, "block_ms": 1000}  # fmt: skip

    def env(self) -> dict[str, str]:
        return client_env()

    def send(self, body: bytes, traceparent: str | None) -> None:
        carried = {"DataType": "String", "StringValue": traceparent}
        attributes = {"traceparent": carried} if traceparent else {}
        self.client.send_message(
            QueueUrl=self.queue_url, MessageBody=body.decode(), MessageAttributes=attributes
        )


class Amqp(Source):
    name = "amqp"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        amqp.declare_queue(url, self.source)

    def adapter(self) -> dict[str, Any]:
        return {"name": "orders", "transport": "amqp", "source": self.source, "queue": QUEUE, "url": self.url,
                "block_ms": 100}  # fmt: skip

    def send(self, body: bytes, traceparent: str | None) -> None:
        headers = {"traceparent": traceparent} if traceparent else None
        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            properties = pika.BasicProperties(message_id=uuid.uuid4().hex, headers=headers)
            connection.channel().basic_publish("", self.source, body, properties)
        finally:
            connection.close()


@contextlib.contextmanager
def source_for(name: str, redis_url: str) -> Iterator[Source]:
    if name == "redis-stream":
        yield RedisStream(redis_url)
    elif name == "nats-jetstream":
        with nats.shared_nats() as url:
            yield NatsJetStream(url)
    elif name == "sqs":
        with sqs.shared_sqs() as url:
            yield Sqs(url)
    elif name == "amqp":
        with amqp.shared_amqp() as url:  # skips, counted in the summary, without RabbitMQ
            yield Amqp(url)
    else:
        raise ValueError(f"no source {name!r}")


@pytest.fixture(params=["redis-stream", "nats-jetstream", "sqs", "amqp"])
def source(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Source]:
    with source_for(request.param, redis_url) as s:
        yield s


@pytest.fixture
def collector() -> Iterator[Collector]:
    with Collector() as c:
        yield c


def _todos(db_url: str) -> dict[str, tuple[str, Any, Any]]:
    """By payload's ``m``: (status, payload, trace_context)."""
    rows = query(db_url, "SELECT status, payload, trace_context FROM todos")
    return {str(p["m"]): (str(s), p, tc) for s, p, tc in rows}


def _all_done(db_url: str, n: int) -> bool:
    todos = _todos(db_url)
    return len(todos) == n and all(status == "done" for status, _, _ in todos.values())


def _of(spans: list[Span], name: str, **attributes: Any) -> list[Span]:
    return [
        s for s in spans if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())
    ]


def _run_spans_of(spans: list[Span], todo_id: int) -> list[Span]:
    return sorted(_of(spans, "switchboard run", **{"messaging.message.id": str(todo_id)}),
                  key=lambda s: s.attributes["switchboard.todo.attempt"])  # fmt: skip


def _children(spans: list[Span], parent: Span) -> list[Span]:
    return [s for s in spans if s.trace_id == parent.trace_id and s.parent_span_id == parent.span_id]


def _todo_id(db_url: str, m: str) -> int:
    return int(query(db_url, "SELECT id FROM todos WHERE payload->>'m' = %(m)s", {"m": m})[0][0])


def _start(procs: Processes, config: Path, verb: str, env: dict[str, str]) -> SwitchboardProcess:
    proc = procs.start(verb, config, name=f"{verb}-1", env=env)
    if verb != "worker":
        wait_ready(proc)
    return proc


def test_the_handlers_spans_are_in_the_producers_trace(
    source: Source,
    collector: Collector,
    procs: Processes,
    make_config: Callable[..., Path],
    db_url: str,
    runs_db: str,
) -> None:
    config = make_config(source.adapter(), queues={QUEUE: HANDLER}, worker={"poll_interval_ms": 200})
    env = {**source.env(), **collector.env()}
    ingester = _start(procs, config, "ingest", env)
    _start(procs, config, "worker", env)
    trace_id, span_id, traceparent = producer_context()
    source.send(json.dumps({"m": "traced", "fail_times": 1}).encode(), traceparent)
    source.send(json.dumps({"m": "malformed"}).encode(), MALFORMED)
    source.send(json.dumps({"m": "none"}).encode(), None)
    wait_for(lambda: _all_done(db_url, 3), timeout_s=90, what=f"{source.name}: 3 todos done")

    # What PostgreSQL keeps: the producer's context, nothing for the others;
    # the payloads as sent, the malformed context no part of its message.
    todos = _todos(db_url)
    assert todos["traced"][2] == {"traceparent": traceparent}
    assert todos["malformed"][1:] == ({"m": "malformed"}, None)
    assert todos["none"][1:] == ({"m": "none"}, None)

    traced, malformed = _todo_id(db_url, "traced"), _todo_id(db_url, "malformed")
    # The operator finds the trace by the todo (the console's todo page reads the same).
    shown = switchboard("--config", str(config), "todos", "show", str(traced))
    assert f"trace_id         {trace_id}" in shown.stdout.splitlines(), shown.stdout + shown.stderr
    spans = collector.wait_for(
        lambda got: (
            len(_run_spans_of(got, traced)) == 2
            and len(_run_spans_of(got, malformed)) == 1
            and len(_of(got, "handler work")) == 4
            and any((trace_id, span_id) in s.links for s in _of(got, "switchboard ingest"))
        ),
        timeout_s=SPANS_TIMEOUT_S,
    )
    # Both runs (the retry's too) are children of the producer's span, each
    # with its attempt and outcome, and the handler's span each run's child.
    runs = _run_spans_of(spans, traced)
    assert [(r.trace_id, r.parent_span_id) for r in runs] == [(trace_id, span_id)] * 2
    outcomes = [
        (r.attributes["switchboard.todo.attempt"], r.attributes["switchboard.run.outcome"]) for r in runs
    ]
    assert outcomes == [(1, "retry"), (2, "done")]
    assert all(r.kind == CONSUMER and r.attributes["messaging.destination.name"] == QUEUE for r in runs)
    assert runs[0].status_code == 2
    assert "exception" in runs[0].events
    for run in runs:
        assert [c.name for c in _children(spans, run)] == ["handler work"]
    # The ingest span of its batch links to the producer's context.
    ingest = [s for s in _of(spans, "switchboard ingest") if (trace_id, span_id) in s.links]
    assert len(ingest) == 1
    assert ingest[0].attributes["switchboard.adapter"] == "orders"
    assert ingest[0].attributes["messaging.system"] in {"redis", "nats", "aws_sqs", "rabbitmq"}
    # The malformed context: its run is a root of a trace of its own.
    (lone,) = _run_spans_of(spans, malformed)
    assert lone.parent_span_id == ""
    assert lone.trace_id != trace_id
    assert len(ingester.events("trace_context_malformed")) == 1
    assert {s.service for s in spans} == {"switchboard-ingest", "switchboard-worker"}


def test_a_webhooks_run_is_a_child_of_its_delivery(
    tmp_path: Path, collector: Collector, procs: Processes, db_url: str, runs_db: str
) -> None:
    adapter = {"name": "billing", "transport": "webhook", "mode": "standard-webhooks", "queue": QUEUE,
               "secrets_env": ["BILLING_WHSEC"]}  # fmt: skip
    config, port = receiver_config(tmp_path / "receiver.toml", db_url, [adapter], queues={QUEUE: HANDLER})
    env = {"BILLING_WHSEC": STANDARD_SECRET, **collector.env()}
    receiver = procs.start("receive", config, name="receiver-1", env=env)
    wait_listening(receiver)
    procs.start("worker", config, name="worker-1", env=env)
    trace_id, span_id, traceparent = producer_context()
    sent = {}
    for m, parent in [("traced", traceparent), ("malformed", MALFORMED)]:
        body = json.dumps({"m": m}).encode()
        headers = {**standard_headers(STANDARD_SECRET, f"msg_{m}", body), "traceparent": parent}
        answer = post(port, "/hooks/billing", body, headers)
        assert answer.status == 200, answer.body
        sent[m] = answer
    wait_for(lambda: _all_done(db_url, 2), timeout_s=90, what="2 webhook todos done")

    spans = collector.wait_for(lambda got: len(_of(got, "handler work")) == 2, timeout_s=SPANS_TIMEOUT_S)
    receives = [s for s in _of(spans, "switchboard receive") if s.trace_id == trace_id]
    assert len(receives) == 1
    (receive,) = receives
    assert receive.parent_span_id == span_id
    assert receive.kind == SERVER
    assert receive.attributes["http.response.status_code"] == 200
    (run,) = _run_spans_of(spans, _todo_id(db_url, "traced"))
    assert (run.trace_id, run.parent_span_id) == (trace_id, receive.span_id)
    assert [c.name for c in _children(spans, run)] == ["handler work"]
    # The malformed header: stored and done alike, its delivery a root.
    (lone,) = [s for s in _of(spans, "switchboard receive") if s.trace_id != trace_id]
    assert lone.parent_span_id == ""
    assert len(receiver.events("trace_context_malformed")) == 1
    # The todo keeps the receive span's context: its run's parent.
    kept = _todos(db_url)["traced"][2]
    assert kept["traceparent"].split("-")[1:3] == [trace_id, receive.span_id]


def test_without_otel_variables_no_context_is_kept(
    procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str, runs_db: str
) -> None:
    source = RedisStream(redis_url)
    config = make_config(source.adapter(), queues={QUEUE: HANDLER}, worker={"poll_interval_ms": 200})
    ingester = _start(procs, config, "ingest", {})
    _start(procs, config, "worker", {})
    _trace_id, _span_id, traceparent = producer_context()
    source.send(json.dumps({"m": "traced"}).encode(), traceparent)
    source.send(json.dumps({"m": "malformed"}).encode(), MALFORMED)
    wait_for(lambda: _all_done(db_url, 2), timeout_s=90, what="2 todos done")
    assert [tc for _, _, tc in _todos(db_url).values()] == [None, None]
    assert not ingester.events("tracing_on")
    assert not ingester.events("trace_context_malformed")


def test_a_run_rescued_after_its_worker_was_killed_joins_the_producers_trace(
    collector: Collector, procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str,
    runs_db: str,
) -> None:  # fmt: skip
    """kill -9 of the worker mid-run: its span dies with it; the rescuer puts
    the todo back once its lease lapses, and the run of a new worker process
    is in the producer's trace all the same (the context is the todo's)."""
    source = RedisStream(redis_url)
    config = make_config(source.adapter(), queues={QUEUE: HANDLER}, acker=FAST_RESCUE, worker=SHORT_LEASE)
    env = collector.env()
    _start(procs, config, "ingest", env)
    _start(procs, config, "ack", env)
    worker = _start(procs, config, "worker", env)
    trace_id, span_id, traceparent = producer_context()
    source.send(json.dumps({"m": "rescued", "sleep_s": 60}).encode(), traceparent)
    wait_for(lambda: scalar(db_url, "SELECT count(*) FROM handler_runs") == 1, timeout_s=60, what="the run")
    query(db_url, "UPDATE todos SET payload = payload - 'sleep_s'")  # the rescued run finishes
    (pid,) = query(db_url, "SELECT pid FROM handler_runs")[0]
    os.kill(pid, signal.SIGKILL)
    worker.wait(30)  # dramatiq's main process ends when one of its workers dies
    procs.start("worker", config, name="worker-2", env=env)
    wait_for(lambda: _all_done(db_url, 1), timeout_s=90, what="the todo rescued and done")
    todo_id = _todo_id(db_url, "rescued")
    spans = collector.wait_for(lambda got: len(_run_spans_of(got, todo_id)) == 1, timeout_s=SPANS_TIMEOUT_S)
    (run,) = _run_spans_of(spans, todo_id)
    assert (run.trace_id, run.parent_span_id) == (trace_id, span_id)
    assert (run.attributes["switchboard.todo.attempt"], run.attributes["switchboard.run.outcome"]) == (
        2,
        "done",
    )
    assert [c.name for c in _children(spans, run)] == ["handler work"]


def test_spans_still_queued_at_a_stop_are_exported(
    collector: Collector, procs: Processes, make_config: Callable[..., Path], db_url: str, redis_url: str,
    runs_db: str,
) -> None:  # fmt: skip
    """SIGTERM exports what the processes still hold: with an export delay of
    ten minutes nothing leaves before the stop, and everything after it."""
    source = RedisStream(redis_url)
    config = make_config(source.adapter(), queues={QUEUE: HANDLER}, worker={"poll_interval_ms": 200})
    env = {**collector.env(), "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    ingester = _start(procs, config, "ingest", env)
    worker = _start(procs, config, "worker", env)
    trace_id, span_id, traceparent = producer_context()
    source.send(json.dumps({"m": "traced"}).encode(), traceparent)
    wait_for(lambda: _all_done(db_url, 1), timeout_s=90, what="the todo done")
    assert collector.spans() == []
    stop_all([ingester, worker])
    spans = collector.wait_for(lambda got: len(_of(got, "switchboard run")) == 1, timeout_s=SPANS_TIMEOUT_S)
    (run,) = _of(spans, "switchboard run")
    assert (run.trace_id, run.parent_span_id) == (trace_id, span_id)
    assert any((trace_id, span_id) in s.links for s in _of(spans, "switchboard ingest"))


@pytest.mark.parametrize("verb", ["ingest", "receive", "worker"])
@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"),
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER=jaeger"),
        ({"OTEL_SPAN_LINK_COUNT_LIMIT": "lots"}, "span limits"),
    ],
)
def test_what_the_otel_variables_ask_that_cannot_be_done_is_exit_2(
    tmp_path: Path, db_url: str, redis_url: str, verb: str, env: dict[str, str], says: str
) -> None:
    adapter = {"name": "billing", "transport": "webhook", "mode": "standard-webhooks", "queue": QUEUE,
               "secrets_env": ["BILLING_WHSEC"]}  # fmt: skip
    config, _port = receiver_config(
        tmp_path / "c.toml", db_url, [adapter, RedisStream(redis_url).adapter()], queues={QUEUE: HANDLER}
    )
    asked = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "BILLING_WHSEC": STANDARD_SECRET, **env}
    result = switchboard("--config", str(config), verb, env=asked, timeout_s=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert says in result.stdout + result.stderr
