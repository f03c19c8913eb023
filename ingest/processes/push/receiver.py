"""``switchboard receive``: the push ingester, an HTTP server for the webhook
adapters (DESIGN.md section 12), on the process skeleton like ``ingest``.

Store-then-respond: a delivery is answered 200 only once the transaction
holding its inbox row, event and todo has committed; anything else makes the
sender retry, and the key dedups the retry. Refusals come cheapest first,
and nothing unauthenticated reaches the database: an unknown adapter 404, a
wrong method 405, a disabled adapter 503, a compressed body 415, missing or
stale signature headers 401, a declared length over ``max_message_bytes``
413 (all before the body is read), then a body too slow (408) or too long
(413), then the signature itself (401). An authentic body that fails
normalization is stored as rejected and answered 200: a 4xx would make the
sender retry it for days and then disable the endpoint. A store that fails
or is not committed within ``respond_within_ms`` is 503 with Retry-After.

uvicorn serves the Starlette app inside this process's TaskGroup, on a
socket bound before any work (a taken port is a config error, exit 2), with
its signal handling off: the skeleton's stop ends it gracefully (no new
connection; requests in flight are answered), then the committers stop.
Its h11 protocol is ``http_guard``'s: a head within a few seconds, the whole
request within ``respond_within_ms`` and a second, connections capped per
address and in all, body bytes in flight capped (:func:`receiver_limits`).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Mapping
from typing import Any

import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backhalf import metrics, tracing
from backhalf.db import within_deadline
from backhalf.errors import DeadlineExceeded, StoreError
from backhalf.tracing import TRACEPARENT, TRACESTATE
from backhalf.writes import registry
from ingest.adapters.base import Delivery, trace_of
from ingest.adapters.webhook import PUSH, push_provenance
from ingest.adapters.webhook.verify import Refused, Scheme, scheme_for
from ingest.config import Settings, WebhookConfig
from ingest.config.webhook import resolve_secrets
from ingest.errors import ConfigError
from ingest.lifecycle import wait_stop
from ingest.processes.http_guard import REQUEST_GRACE_S, Limits, within_file_limit
from ingest.processes.http_server import Server, bind, guarded_config
from ingest.processes.intake import Registration, register_adapters, to_record, trace_context_of
from ingest.processes.push.push_store import PushStore
from ingest.processes.skeleton import Job, Process, ProcessBody, run_process

log = structlog.get_logger(__name__)

RETRY_AFTER_S = 5
REFUSAL_LOG_EVERY_S = 10.0  # one delivery_refused line per adapter and reason per this, with a count
NORMALIZE_INLINE_BYTES = 64 * 1024  # larger bodies, or any with a schema, are decoded off the loop
UNKNOWN = "-"  # the metrics' adapter label of a path that names none
ANY_METHOD = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT")
# Requests served at once, counting those whose sender has gone and whose
# store is still running; past it uvicorn answers 503 itself (the sender
# retries). Connections are capped below it (http_guard): an idle socket
# never counts here.
MAX_CONCURRENT_REQUESTS = 2000
# Connections open at once (fewer under a low open-file limit), half of them
# from one address at most; one waiting for its head is cut for a newcomer.
MAX_CONNECTIONS = 1000
# Request bodies received and not yet answered, over all requests (at least
# two of the largest max_message_bytes): a delivery whose declared length
# does not fit is 503 with Retry-After before its body is read.
BODY_BYTES_IN_FLIGHT = 64 * 1024 * 1024


def receiver_limits(settings: Settings) -> Limits:
    """What one client may hold of the receiver. A declared length over an
    adapter's ``max_message_bytes`` is the app's 413 (with its metric), never
    the guard's; whatever body does arrive counts against the bytes in flight."""
    largest = max(w.max_message_bytes for w in settings.webhooks)
    return Limits(
        request_timeout_s=settings.receiver.respond_within_ms / 1000 + REQUEST_GRACE_S,
        max_connections=within_file_limit(MAX_CONNECTIONS),
        max_body_bytes=largest,
        body_bytes_in_flight=max(BODY_BYTES_IN_FLIGHT, 2 * largest),
        refuse_too_large=False,
    )


def webhook_key(cfg: WebhookConfig, delivery_id: str) -> str:
    return f"{cfg.key_prefix}:{cfg.source}:{delivery_id}"


class _Refusals:
    """Rate-limited log lines for refused deliveries: anyone can send a
    request, so a flood of bad ones costs a metric each and a line per
    adapter and reason every REFUSAL_LOG_EVERY_S."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}
        self._quiet: dict[tuple[str, str], int] = {}

    def note(self, adapter: str, refused: Refused) -> None:
        if metrics.on():
            metrics.WEBHOOK_REFUSED.labels(adapter, refused.reason).inc()
        key = (adapter, refused.reason)
        now = time.monotonic()
        if now - self._last.get(key, -REFUSAL_LOG_EVERY_S) < REFUSAL_LOG_EVERY_S:
            self._quiet[key] = self._quiet.get(key, 0) + 1
            return
        self._last[key] = now
        log.warning(
            "delivery_refused",
            adapter=adapter,
            status=refused.status,
            reason=refused.reason,
            detail=str(refused),
            refused_since_last_line=self._quiet.pop(key, 0),
        )


class Endpoint:
    """One webhook adapter's route: its checks, then the store."""

    def __init__(self, cfg: WebhookConfig, scheme: Scheme, push: PushStore, settings: Settings) -> None:
        self.cfg = cfg
        self._scheme = scheme
        self._push = push
        self._body_timeout_s = settings.receiver.body_timeout_ms / 1000
        self.enabled = True

    async def receive(self, request: Request, trace_context: str | None = None) -> Response:
        """Check, store and answer one delivery; ``trace_context``: what its
        todo keeps (the receive span's, while tracing is on)."""
        cfg = self.cfg
        if not self.enabled:
            return _unavailable(f"adapter {cfg.name} is disabled")
        encodings = [
            e.strip().lower() for h in request.headers.getlist("content-encoding") for e in h.split(",")
        ]
        if any(e != "identity" for e in encodings):
            raise Refused(415, "compressed", "a compressed body is not accepted: send it as it is")
        signed = self._scheme.check_headers(request.headers)
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise Refused(400, "bad_length", "Content-Length is no number")
            if int(declared) > cfg.max_message_bytes:
                raise _too_large(cfg)
        body = await self._body(request)
        verified = self._scheme.verify(signed, body)
        key = webhook_key(cfg, verified.delivery_id)
        delivery = Delivery(key, verified.delivery_id, body=body, ack_ref=None)
        if cfg.body_schema is None and len(body) <= NORMALIZE_INLINE_BYTES:
            record = to_record(delivery, cfg)
        else:
            record = await asyncio.to_thread(to_record, delivery, cfg)
        if trace_context is not None:
            record = record._replace(trace_context=trace_context)
        provenance = push_provenance(cfg.mode, verified)
        # An unsigned delivery id (GitHub's) names no message: another body
        # under a stored one is stored as its own (push_store, issue 43).
        await self._push.store(
            cfg.name, cfg.queue, provenance, record, id_names_message=self._scheme.signs_delivery_id
        )
        return JSONResponse({"status": "stored" if record.error is None else "rejected"})

    async def _body(self, request: Request) -> bytes:
        limit = self.cfg.max_message_bytes
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self._body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(self.cfg)
                    chunks.append(chunk)
        except TimeoutError as exc:
            raise Refused(
                408, "body_timeout", f"the body did not arrive within {self._body_timeout_s:g} s"
            ) from exc
        except ClientDisconnect as exc:  # the sender gave up (its own timeout): it will retry
            raise Refused(
                400, "disconnected", "the sender closed the connection before its body ended"
            ) from exc
        return b"".join(chunks)


def _too_large(cfg: WebhookConfig) -> Refused:
    return Refused(413, "too_large", f"the body is over max_message_bytes={cfg.max_message_bytes}")


def _refusal(refused: Refused, headers: Mapping[str, str] | None = None) -> Response:
    # Connection: close, as the body may be unread (a 413 by its declared
    # length, a 408): uvicorn would otherwise read and discard the rest.
    return JSONResponse(
        {"error": refused.reason, "detail": str(refused)},
        status_code=refused.status,
        headers={"Connection": "close", **(headers or {})},
    )


def _unavailable(why: str) -> Response:
    return JSONResponse(
        {"error": "unavailable", "detail": why}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}
    )


class Receiver:
    """The app's handlers over the endpoints; the request deadline."""

    def __init__(self, endpoints: Mapping[str, Endpoint], settings: Settings, process: Process) -> None:
        self._endpoints = endpoints
        self._respond_within_s = settings.receiver.respond_within_ms / 1000
        self._process = process
        self._refusals = _Refusals()

    def app(self) -> Starlette:
        app = Starlette(
            routes=[
                # Every method reaches the handler: an unknown adapter is 404
                # before a wrong method is 405, and both are counted.
                Route("/hooks/{adapter}", self.hook, methods=list(ANY_METHOD)),
                Route("/healthz", self.healthz, methods=["GET"]),
            ]
        )
        # /hooks/billing/ is no route: not a redirect built from the Host header.
        app.router.redirect_slashes = False
        return app

    async def hook(self, request: Request) -> Response:
        endpoint = self._endpoints.get(request.path_params["adapter"])
        if endpoint is None:
            return self._answered(UNKNOWN, JSONResponse({"error": "no such adapter"}, status_code=404))
        name = endpoint.cfg.name
        if request.method != "POST":
            refused = Refused(405, "method", "deliveries are POSTed")
            self._refusals.note(name, refused)
            return self._answered(name, _refusal(refused, headers={"Allow": "POST"}))
        if not tracing.on():
            return self._answered(name, await self._deliver(endpoint, request))
        # The sender's context is the span's parent; the todo keeps the
        # span's own, so its run is the delivery's child (DESIGN.md section 14).
        sent = trace_of(request.headers.get(TRACEPARENT), request.headers.get(TRACESTATE))
        sender = None if sent is None else trace_context_of(sent, endpoint.cfg)
        with tracing.receive_span(adapter=name, path=request.url.path, sender=sender) as span:
            response = await self._deliver(endpoint, request, span.context())
            span.answered(response.status_code)
        return self._answered(name, response)

    async def _deliver(
        self, endpoint: Endpoint, request: Request, trace_context: str | None = None
    ) -> Response:
        """The endpoint's answer, or the answer to its refusal or failure."""
        name = endpoint.cfg.name
        try:
            async with asyncio.timeout(self._respond_within_s):
                response = await endpoint.receive(request, trace_context)
        except Refused as refused:
            self._refusals.note(name, refused)
            response = _refusal(refused)
        except TimeoutError:
            log.warning("delivery_unanswered", adapter=name, within_s=self._respond_within_s)
            response = _unavailable(f"not stored within {self._respond_within_s:g} s")
        except (StoreError, DeadlineExceeded) as exc:
            log.warning("store_failed", adapter=name, error=str(exc), cause=metrics.error_class(exc))
            response = _unavailable("the database did not commit the delivery")
        return response

    def _answered(self, adapter: str, response: Response) -> Response:
        if metrics.on():
            metrics.WEBHOOK_RESPONSES.labels(adapter, str(response.status_code)).inc()
        return response

    async def healthz(self, _request: Request) -> Response:
        ok, report = self._process.liveness.report()
        return JSONResponse(report, status_code=200 if ok else 503, headers={"Cache-Control": "no-store"})


async def run_receiver(settings: Settings, stop: asyncio.Event, *, env: Mapping[str, str]) -> None:
    if not settings.webhooks:
        raise ConfigError(
            '[[adapters]]: `switchboard receive` needs at least one adapter with transport = "webhook"'
        )
    # Before any work: a missing secret or a port taken is exit 2.
    schemes = {w.name: scheme_for(w, resolve_secrets(w, env)) for w in settings.webhooks}
    sock = bind(settings.receiver.listen, "[receiver] listen")
    try:
        await run_process(settings, stop, lambda engine: _ReceiverBody(settings, engine, schemes, sock))
    finally:
        sock.close()


class _ReceiverBody(ProcessBody):
    role = "receive"
    traced = True
    stopped_event = "receiver_stopped"
    overdue_field = "tasks"

    def __init__(
        self, settings: Settings, engine: AsyncEngine, schemes: Mapping[str, Scheme], sock: socket.socket
    ) -> None:
        # Requests in flight get their whole deadline (uvicorn's drain, below,
        # is a second longer), then the committers finish.
        self.shutdown_timeout_s = settings.receiver.respond_within_ms / 1000 + max(
            settings.ingest.shutdown_timeout_s, 2.0
        )
        self._settings = settings
        self._engine = engine
        self._sock = sock
        self._push = PushStore(engine, settings.database.transaction_deadline_ms)
        self._endpoints = {
            w.name: Endpoint(w, schemes[w.name], self._push, settings) for w in settings.webhooks
        }
        self._detail = {"adapters": sorted(self._endpoints), "listen": settings.receiver.listen}

    async def start(self, process: Process) -> bool:
        rows = [
            Registration(w.name, PUSH, w.transport, w.mode, w.public_settings())
            for w in self._settings.webhooks
        ]
        if not await register_adapters(self._engine, self._settings, process.stop, rows):
            return False
        await self._read_flags(process.deadline_ms)  # a disabled adapter is 503 from the first request
        return True

    def spawn(self, process: Process) -> None:
        process.work(self._serve(process), name="http")
        process.beside(self._refresh_enabled(process), name="enabled-flags")

    async def _serve(self, process: Process) -> None:
        receiver = Receiver(self._endpoints, self._settings, process)
        limits = receiver_limits(self._settings)
        config = guarded_config(
            receiver.app(),
            limits,
            graceful_s=int(self._settings.receiver.respond_within_ms / 1000) + 1,
            limit_concurrency=MAX_CONCURRENT_REQUESTS,
        )
        server = Server(config)
        async with asyncio.TaskGroup() as tg:
            committers = tg.create_task(self._push.run(process.stop), name="push-committers")
            serving = tg.create_task(server.serve(sockets=[self._sock]), name="uvicorn")
            up = tg.create_task(server.up.wait(), name="uvicorn-up")
            await asyncio.wait([up, serving], return_when=asyncio.FIRST_COMPLETED)
            up.cancel()
            if server.started:
                log.info(
                    "receiver_listening",
                    listen=self._settings.receiver.listen,
                    adapters=sorted(self._endpoints),
                    max_connections=limits.max_connections,
                    max_per_client=limits.max_per_client,
                )
            await process.stop.wait()
            server.should_exit = True  # no new connection; requests in flight are answered
            await serving
            committers.cancel()  # no request is left to hand one a record

    async def _refresh_enabled(self, process: Process) -> None:
        """The enabled flags, read every ``enabled_refresh_ms``; a failed read
        keeps the last known (the stores fail anyway while the database is away)."""
        interval_s = self._settings.ingest.enabled_refresh_ms / 1000
        tick = process.watch("enabled-flags", interval_s)
        while not process.stop.is_set():
            tick()
            await wait_stop(process.stop, interval_s)
            await self._read_flags(process.deadline_ms)

    async def _read_flags(self, deadline_ms: int) -> None:
        try:
            async with within_deadline(self._engine.connect(), deadline_ms, "reading the flags") as conn:
                rows = await registry.list_adapters(conn)
        except (SQLAlchemyError, DeadlineExceeded) as exc:
            log.warning("enabled_flags_unread", error=str(exc))
            return
        flags = {r.name: r.enabled for r in rows}
        for name, endpoint in self._endpoints.items():
            enabled = flags.get(name, True)
            if enabled != endpoint.enabled:
                log.info("adapter_enabled" if enabled else "adapter_disabled", adapter=name)
            endpoint.enabled = enabled

    def detail(self) -> Mapping[str, Any]:
        return self._detail

    def gauges(self, process: Process, interval_s: float) -> tuple[str, Job]:
        return "enabled-gauges", self._gauges(process, interval_s)

    async def _gauges(self, process: Process, interval_s: float) -> None:
        while not process.stop.is_set():
            for name, endpoint in self._endpoints.items():
                metrics.ADAPTER_ENABLED.labels(name).set(1 if endpoint.enabled else 0)
            await wait_stop(process.stop, interval_s)

    async def close(self) -> None:
        """Nothing: the engine is the skeleton's, the socket run_receiver's."""
