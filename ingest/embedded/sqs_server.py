"""An SQS-compatible emulator on loopback, owned by Python.

No wheel ships SQS itself: the emulator is moto's server (the ``embedded``
extra's ``moto[sqs,sts]`` and Flask), run as our child as
:mod:`ingest.embedded.nats_server` runs nats-server: a free port, a private
base directory and log (umask 077), every wait bounded, and the process
dying with us. The child is ``python -m ingest.embedded.moto_sqs``, moto with
three fixes to its SQS: a FIFO group redelivered from its first message, one
call at a time, and receives that do not slow down with the backlog (that
module says why). Readiness is an SQS ``ListQueues`` answered in SQS's JSON
protocol.

What an emulator cannot show (DESIGN.md section 6b): moto keeps every queue
and message in memory, so a restart (or a kill) loses them all, queues
included, where nats-server and Valkey keep theirs on disk; AWS's own limits
and throttling are not there; moto checks no signature and no permission;
and the differences ``ingest.embedded.moto_sqs`` lists.

Access: moto accepts any credentials, and AWS's SDKs insist on having some,
so clients use the fixed ``ACCESS_KEY_ID`` / ``SECRET_ACCESS_KEY``
(``client_env``). They are the emulator's dummies, not secrets, and guard
nothing: any local user can reach the port, as with moto anywhere. It holds
test and demo data only.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ingest.embedded.servers import (
    _log_reason,
    _private_dir,
    _private_file,
    _SignalledServer,
    free_port,
    log_since,
    spawn,
)

REGION = "us-east-1"
# The emulator's own credentials (moto takes any): not secrets.
ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "testing"  # noqa: S105 - a fixed dummy, see the module docstring
# The child's module: ours (moto with the fixes), or "moto.server" (plain
# moto, for the test that shows what the FIFO fix is for).
MOTO_SQS_MODULE = "ingest.embedded.moto_sqs"
PROBE_TIMEOUT_S = 0.5
# moto routes a request to a service by the credential scope of its
# Authorization header and checks no signature: this one names SQS.
_PROBE_HEADERS = {
    "X-Amz-Target": "AmazonSQS.ListQueues",
    "Content-Type": "application/x-amz-json-1.0",
    "Authorization": (
        f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY_ID}/20260101/{REGION}/sqs/aws4_request,"
        " SignedHeaders=host, Signature=0"
    ),
}


def client_env(region: str = REGION) -> dict[str, str]:
    """The environment variables a client of the emulator runs with: the
    dummy credentials and the region. A caller's session token and its
    expiry are blanked, so neither goes with the dummy keys."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
        "AWS_SESSION_TOKEN": "",
        "AWS_SECURITY_TOKEN": "",
        "AWS_CREDENTIAL_EXPIRATION": "",
        "AWS_DEFAULT_REGION": region,
    }


def _answers_sqs(url: str) -> bool:
    """True when ``url`` answers ``ListQueues`` as SQS does (a JSON object
    in the x-amz-json protocol), not merely some HTTP server; OSError when
    it does not answer, or answers with an HTTP error."""
    request = urllib.request.Request(url + "/", data=b"{}", headers=_PROBE_HEADERS, method="POST")  # noqa: S310 - http on loopback
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as reply:  # noqa: S310
            kind = reply.headers.get("Content-Type", "")
            body = reply.read()
    except urllib.error.HTTPError as exc:  # some other HTTP server, or not ready
        exc.close()  # its socket: kept as the last error it would outlive the probe
        raise OSError(f"ListQueues answered {exc.code}") from exc
    if reply.status != 200 or not kind.startswith("application/x-amz-json"):
        return False
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


class SqsServer(_SignalledServer):
    """One moto server, SQS only in use, in the foreground as our child.
    Everything it holds is in memory: ``restart`` keeps the port, not the queues."""

    region = REGION
    _label, _serving_as = "the SQS emulator (moto)", "answering ListQueues"

    def __init__(self, base_dir: Path, port: int, module: str = MOTO_SQS_MODULE) -> None:
        self.base_dir, self.port, self.module = base_dir, port, module
        self.log_path = base_dir / "sqs.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def create(cls, base_dir: Path, *, module: str = MOTO_SQS_MODULE) -> SqsServer:
        """A server for a free port in ``base_dir`` (created 0700), not started."""
        base_dir = Path(base_dir).resolve()
        _private_dir(base_dir)
        return cls(base_dir, free_port(), module)

    @property
    def url(self) -> str:
        """The endpoint, e.g. ``http://127.0.0.1:20123`` (no credentials in it)."""
        return f"http://127.0.0.1:{self.port}"

    def client_env(self) -> dict[str, str]:
        """See the module's ``client_env``."""
        return client_env(self.region)

    def start(self, timeout_s: float = 20) -> None:
        """Start the server and wait until it answers SQS's ``ListQueues``.
        On its first start only, a port taken meanwhile is traded for
        another (a restart keeps its port: clients know it)."""
        self._start_serving(timeout_s)

    def _spawn(self) -> subprocess.Popen[bytes]:
        with _private_file(self.log_path) as log:  # the child keeps its own copy of the descriptor
            return spawn(
                [sys.executable, "-m", self.module, "--host", "127.0.0.1", "--port", str(self.port)],
                self.base_dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},  # a traceback reaches the log whole
            )

    def _serving(self, proc: subprocess.Popen[bytes]) -> bool:
        return _answers_sqs(self.url)  # refused (OSError) while the child imports moto

    def _exit_reason(self, mark: Any) -> tuple[bool, str]:
        # Werkzeug says so on a line of its own, then a longer line of advice.
        if "address already in use" in log_since(self.log_path, mark).lower():
            return True, "Address already in use"
        return False, _log_reason(self.log_path, mark)

    def _take_other_ports(self) -> None:
        self.port = free_port()


def sqs_server(
    base_dir: Path, *, module: str = MOTO_SQS_MODULE
) -> contextlib.AbstractContextManager[SqsServer]:
    """A started :class:`SqsServer` in ``base_dir``, cleaned up on exit."""
    return SqsServer.create(base_dir, module=module).started()
