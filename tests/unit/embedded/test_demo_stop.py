"""A stop signal raised inside a call that was opening a socket: the demo's
clean stop closes what that call left, without a ResourceWarning (which the
suite's ``-W error`` turns into a traceback on the demo's stderr)."""

from __future__ import annotations

import gc
import signal
import socket
import warnings

from ingest.embedded.demo import Stopped, release_interrupted


def _connect_interrupted() -> None:
    sock = socket.socket()  # noqa: F841 - a library's local, as redis-py's connect has it
    raise Stopped(signal.SIGTERM)  # where the signal handler raises


def _resource_warnings(release: bool) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            _connect_interrupted()
        except Stopped as stop:
            if release:
                release_interrupted(stop)
        gc.collect()
    return [w for w in seen if issubclass(w.category, ResourceWarning)]


def test_the_socket_an_interrupted_call_left_is_closed_without_a_warning() -> None:
    assert _resource_warnings(release=True) == []


def test_without_the_release_the_warning_comes_so_the_test_above_can_fail() -> None:
    assert len(_resource_warnings(release=False)) == 1
