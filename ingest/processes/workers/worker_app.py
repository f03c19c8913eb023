"""The module ``switchboard worker`` hands to dramatiq's CLI (``python -m
dramatiq ingest.processes.workers.worker_app``): each worker process imports it and gets the
broker of ``SWITCHBOARD_CONFIG`` with Switchboard's middleware, which
declares the queues' actors at process boot. Logs are Switchboard's
(structured, credentials redacted)."""

from __future__ import annotations

import multiprocessing
import os

import dramatiq

from backhalf import failpoints
from ingest.children import end_with_parent
from ingest.observe import logs
from ingest.processes.workers.worker import app_broker

main_process = multiprocessing.parent_process()
if main_process is not None and main_process.pid is not None:
    # A worker process dramatiq forked dies with its main process, as if
    # killed with it, instead of consuming alone and unsupervised: a run it
    # had under way is rescued when its lease expires. (SIGKILL, not a
    # graceful SIGTERM: with the main process gone, a graceful stop can hang
    # on the log pipe it writes to.) Only when the main process forked it
    # itself: under the forkserver start method (Python 3.14's default) the
    # parent is the fork server, and arming against it is not possible.
    end_with_parent(main_process.pid)
logs.configure()
failpoints.configure(os.environ.get("SWITCHBOARD_FAILPOINTS", ""))
logs.redact_uncaught_tracebacks()
broker = app_broker()
dramatiq.set_broker(broker)
