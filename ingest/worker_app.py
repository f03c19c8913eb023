"""The module ``switchboard worker`` hands to dramatiq's CLI (``python -m
dramatiq ingest.worker_app``): each worker process imports it and gets the
broker of ``SWITCHBOARD_CONFIG`` with Switchboard's middleware, which
declares the queues' actors at process boot. Logs are Switchboard's
(structured, credentials redacted)."""

from __future__ import annotations

import dramatiq

from ingest import logs
from ingest.worker import app_broker

logs.configure()
logs.redact_uncaught_tracebacks()
broker = app_broker()
dramatiq.set_broker(broker)
