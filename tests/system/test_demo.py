"""``switchboard demo``: the whole pipeline on embedded servers prints its story
and OK; a stop signal or its death leaves nothing running, a server that
cannot start is one line (ingest/embedded/demo.py)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ingest.embedded import demo, rabbitmq_server, servers
from ingest.embedded.processes import STRICT_FLAGS, wait_for
from tests.support.amqp import require_rabbitmq
from tests.support.processes import switchboard

pytestmark = pytest.mark.system


def test_demo_runs_the_whole_pipeline_on_embedded_servers() -> None:
    result = switchboard("demo", "--messages", "600", timeout_s=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "duplicates              0" in result.stdout
    assert "messages produced       600" in result.stdout
    assert "todos created           600" in result.stdout
    assert "OK: no loss, no duplicate" in result.stdout


def test_demo_traces_one_order_from_its_producer_to_its_handler() -> None:
    """``--trace`` (issue 47): every process exports to the demo's own OTLP
    collector; the traced order's two runs (its first fails) are in its
    producer's trace, each with the handler's span under it, and the batch
    that stored it links to it."""
    result = switchboard("demo", "--messages", "600", "--trace", timeout_s=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: no loss, no duplicate" in result.stdout
    shown = result.stdout.split("\n  trace ", 1)[1]
    assert re.match(r"[0-9a-f]{32} of order 507 \(the demo its producer, span [0-9a-f]{16}\):", shown), shown
    lines = [line.strip() for line in shown.splitlines()[1:] if line.strip()]
    assert lines[0].startswith("switchboard ingest   [switchboard-ingest] system=redis"), lines
    assert "linked to the order's" in lines[0]
    assert lines[1].startswith("switchboard run      [switchboard-worker]")
    assert "attempt=1, outcome=retry" in lines[1]
    assert lines[2].startswith("fulfil order")
    assert "attempt=2, outcome=done" in lines[3]
    assert lines[4].startswith("fulfil order")


def test_demo_over_nats_ignores_the_callers_switchboard_environment() -> None:
    """``--transport nats``: the same story through JetStream on a nats-server
    of the demo's own, and no Redis at all (issue 42: the workers take their
    todos from PostgreSQL): PostgreSQL is the one server on its line. And a
    user who exported SWITCHBOARD_DATABASE_URL for production (as the
    README's "A minimal deployment" does) and runs the demo: its processes
    use the demo's own servers, never the database, Redis or NATS the
    environment names."""
    elsewhere = {
        "SWITCHBOARD_DATABASE_URL": "postgresql://someone@127.0.0.1:1/production",
        "SWITCHBOARD_REDIS_URL": "redis://127.0.0.1:1/0",
        "SWITCHBOARD_NATS_URL": "nats://127.0.0.1:1",
    }
    result = switchboard("demo", "--transport", "nats", "--messages", "300", env=elsewhere, timeout_s=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "NATS (JetStream) on 127.0.0.1:" in result.stdout
    assert re.search(r"^demo: PostgreSQL on 127\.0\.0\.1:\d+ \(pid \d+\)$", result.stdout, re.MULTILINE)
    assert "valkey" not in result.stdout.lower()
    assert "redis" not in result.stdout.lower()
    assert "todos created           300" in result.stdout
    assert "todos done (workers)    300" in result.stdout
    assert "acked (+ACK)            300" in result.stdout
    assert "unacked in JetStream    0" in result.stdout
    assert "verify_detail      nats user: switchboard" in result.stdout
    assert "OK: no loss, no duplicate" in result.stdout


def test_demo_over_sqs() -> None:
    """``--transport sqs``: the same story through an SQS queue on the demo's
    own emulator; the caller's endpoint variable is not used."""
    elsewhere = {"SWITCHBOARD_SQS_ENDPOINT_URL": "http://127.0.0.1:1"}
    result = switchboard("demo", "--transport", "sqs", "--messages", "300", env=elsewhere, timeout_s=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SQS (moto's emulator) on 127.0.0.1:" in result.stdout
    assert "todos created           300" in result.stdout
    assert "acked (DeleteMessageBatch) 300" in result.stdout
    assert "left in the SQS queue   0" in result.stdout
    assert "verify_detail      aws arn: " in result.stdout
    assert "OK: no loss, no duplicate" in result.stdout


def test_demo_over_amqp() -> None:
    """``--transport amqp``: the same story through a RabbitMQ queue on the
    demo's own broker (the system's rabbitmq-server), acked by the ingester
    itself; the caller's URL variable is not used. Once it is over, nothing
    of its broker runs: not the VM, not its epmd, not their helpers."""
    require_rabbitmq()
    elsewhere = {"SWITCHBOARD_AMQP_URL": "amqp://someone:secret@127.0.0.1:1/"}
    result = switchboard("demo", "--transport", "amqp", "--messages", "300", env=elsewhere, timeout_s=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "RabbitMQ on 127.0.0.1:" in result.stdout
    assert "todos created           300" in result.stdout
    assert "acked (basic.ack)       300" in result.stdout
    assert "left in the RabbitMQ queue 0" in result.stdout
    assert "verify_detail      amqp user: switchboard vhost: /" in result.stdout
    assert "OK: no loss, no duplicate" in result.stdout
    folder = re.search(r"demo: working in (\S+)", result.stdout)
    node = re.search(r"RabbitMQ on \S+ \(pid (\d+), node (\S+)\)", result.stdout)
    assert folder is not None, result.stdout
    assert node is not None, result.stdout
    base = Path(folder[1])
    assert _stat(int(node[1])) is None
    assert _running_in(base) == []
    assert _mentioning(node[2]) == []
    assert not base.exists()


def test_demo_over_amqp_without_rabbitmq_is_one_line_and_starts_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No rabbitmq-server here: one line saying how to get it, exit 2 (like
    a config error: running it again as it is will not help), before any
    server or folder is made."""
    tmp = Path(tempfile.mkdtemp(prefix="switchboard-test-tmp-"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    missing = (
        "no rabbitmq-server (looked in /usr/lib/rabbitmq/bin and on PATH): apt-get install rabbitmq-server"
    )
    monkeypatch.setattr(rabbitmq_server, "rabbitmq_missing", lambda: missing)
    try:
        assert demo.run(messages=10, transport="amqp") == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        said = "--transport amqp runs a RabbitMQ of its own from the system's package"
        assert captured.err.splitlines() == [f"switchboard demo: {said}: {missing}"]
        assert list(tmp.iterdir()) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# The demo's own children: the servers, the ingester and the acker, and
# PostgreSQL's backends below the postmaster (Linux /proc).
PREFIX = demo.PREFIX


def _stat(pid: int) -> list[str] | None:
    """The fields after "pid (comm)" of a live process; None if gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def _tree(root: int) -> dict[int, list[str]]:
    """Every live descendant of ``root``, with its command line's words."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        if (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: dict[int, list[str]] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            # Valkey rewrites its title into argv[0] ("valkey-server 127.0.0.1:port").
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            found[pid] = cmdline.replace("\0", " ").split()
        todo += children.get(pid, [])
    return found


def _running_in(folder: Path) -> list[int]:
    """Live processes whose working directory is in ``folder`` (PostgreSQL's, by then re-parented)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if os.readlink(entry / "cwd").startswith(str(folder)) and _stat(int(entry.name)):
                found.append(int(entry.name))
    return found


def _mentioning(word: str) -> list[int]:
    """Live processes whose command line holds ``word`` (a RabbitMQ node's name)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if word.encode() in (entry / "cmdline").read_bytes() and _stat(int(entry.name)):
                found.append(int(entry.name))
    return found


def _roles(tree: dict[int, list[str]], demo_pid: int) -> dict[str, int]:
    roles = {}
    for pid, argv in tree.items():
        fields = _stat(pid)
        if fields is None or int(fields[1]) != demo_pid or not argv:  # no argv: exiting, or not yet exec'd
            continue
        name = Path(argv[0]).name
        if name == "postgres":
            roles["postmaster"] = pid
        elif name in ("valkey-server", "redis-server"):
            roles["valkey"] = pid
        elif name == "nats-server":
            roles["nats"] = pid
        elif "--consumer" in argv:
            roles["ingester"] = pid
        elif argv[-1] == "ack":
            roles["acker"] = pid
        elif (
            "ingest.processes.workers.worker_app" in argv
        ):  # `switchboard worker`, exec'd into dramatiq's CLI
            roles["worker"] = pid
    return roles


def _expected_roles(transport: str) -> set[str]:
    """The demo's children once it runs: Valkey for the Redis transport only."""
    return {"postmaster", "ingester", "acker", "worker"} | (
        {"valkey"} if transport == "redis" else {"nats"} if transport == "nats" else set()
    )


def _start_demo(
    tmp_path: Path, transport: str = "redis"
) -> tuple[subprocess.Popen[bytes], Path, Path, dict[int, list[str]]]:
    """A long demo, until its servers, ingester, acker and workers run: the
    process, its output file, its folder and its process tree then."""
    out = tmp_path / "demo.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    command = [sys.executable, *STRICT_FLAGS, "-m", "ingest", "demo", "--messages", "10000000"]
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [*command, "--transport", transport],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        match = wait_for(
            lambda: proc.poll() is None and re.search(r"demo: working in (\S+)", out.read_text()),
            timeout_s=120,
            what=f"the demo to report its folder; {out}",
        )
        expected = _expected_roles(transport)
        wait_for(
            lambda: proc.poll() is None and set(_roles(_tree(proc.pid), proc.pid)) >= expected,
            timeout_s=60,
            what=f"the demo's {', '.join(sorted(expected))}",
        )
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
    tree = _tree(proc.pid)
    assert "PostgreSQL on 127.0.0.1:" in out.read_text()
    return proc, out, Path(match[1]), tree


def _assert_all_gone(tree: dict[int, list[str]], base: Path) -> None:
    wait_for(
        lambda: not [p for p in tree if _stat(p)] and not _running_in(base),
        timeout_s=30,
        what=f"the demo's children to die: {[(p, tree[p][:1]) for p in tree if _stat(p)]}",
    )


def _sigterm_stops_it_all(
    proc: subprocess.Popen[bytes], out: Path, tree: dict[int, list[str]], base: Path
) -> None:
    """SIGTERM: the demo says so, exits 128 + 15, and leaves nothing behind."""
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=90)
    text = out.read_text()
    assert code == 128 + signal.SIGTERM, text
    assert "demo: stopped by SIGTERM" in text
    assert "Traceback" not in text, text
    _assert_all_gone(tree, base)
    assert not base.exists()


def test_sigterm_stops_everything_the_demo_started_and_removes_its_folder(tmp_path: Path) -> None:
    proc, out, base, tree = _start_demo(tmp_path)
    _sigterm_stops_it_all(proc, out, tree, base)


def test_a_demo_over_nats_runs_no_redis_and_sigterm_stops_it_all(tmp_path: Path) -> None:
    """Issue 42: a deployment that ingests from no Redis runs none. The demo
    over NATS, running: its children are PostgreSQL, nats-server, the
    ingester, the acker and the workers, and no Valkey or Redis anywhere in
    its process tree; it says so (PostgreSQL alone on its line). A stop
    signal stops them all."""
    proc, out, base, tree = _start_demo(tmp_path, "nats")
    names = {Path(argv[0]).name for argv in tree.values() if argv}
    assert not names & {"valkey-server", "redis-server"}, names
    assert set(_roles(tree, proc.pid)) == _expected_roles("nats")
    text = out.read_text()
    assert re.search(r"^demo: PostgreSQL on 127\.0\.0\.1:\d+ \(pid \d+\)$", text, re.MULTILINE), text
    _sigterm_stops_it_all(proc, out, tree, base)


def test_sigterm_stops_the_demos_rabbitmq_and_its_epmd(tmp_path: Path) -> None:
    """``--transport amqp``: the broker's VM, its helpers and its epmd are
    the demo's children too, and a stop signal stops them all."""
    require_rabbitmq()
    proc, out, base, tree = _start_demo(tmp_path, "amqp")
    names = {Path(argv[0]).name for argv in tree.values() if argv}
    assert {"beam.smp", "epmd"} <= names, names
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=90)
    text = out.read_text()
    assert code == 128 + signal.SIGTERM, text
    assert "demo: stopped by SIGTERM" in text
    assert "Traceback" not in text, text
    _assert_all_gone(tree, base)
    node = re.search(r"RabbitMQ on \S+ \(pid \d+, node (\S+)\)", text)
    assert node is not None, text
    assert _mentioning(node[1]) == []
    assert not base.exists()


def test_the_demos_children_die_with_it_and_the_next_demo_removes_its_folder(tmp_path: Path) -> None:
    """kill -9: no clean-up of the demo's runs, yet its servers and processes
    die with it (PR_SET_PDEATHSIG); its folder stays until a demo starts next."""
    proc, _, base, tree = _start_demo(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    _assert_all_gone(tree, base)
    assert base.exists()
    assert base in servers.remove_abandoned(PREFIX)  # what the next demo does first
    assert not base.exists()


@pytest.mark.parametrize("failing", ["PostgreSQL", "valkey-server"])
def test_a_server_that_cannot_start_is_one_line_and_leaves_no_folder(
    failing: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its port taken: one line on stderr naming the server and the cause, exit
    1, nothing left in the temporary directory and nothing left running."""
    tmp = Path(tempfile.mkdtemp(prefix="switchboard-test-tmp-"))
    tmp.chmod(0o755)  # PostgreSQL runs as a user of its own under root
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = [busy, servers.free_port()] if failing == "PostgreSQL" else [servers.free_port(), busy]
        monkeypatch.setattr(servers, "free_port", lambda: ports.pop(0))
        # One try: a server whose port was taken would otherwise move to
        # another (test_servers covers that); this test is about a server
        # that cannot start at all.
        monkeypatch.setattr(servers, "PORT_ATTEMPTS", 1)
        try:
            code = demo.run(messages=10)
            captured = capsys.readouterr()
            assert code == 1
            assert captured.err.splitlines() == [
                f"switchboard demo: {failing} could not start on 127.0.0.1:{busy} (exit 1): "
                + captured.err.split("(exit 1): ", 1)[1].rstrip("\n")
            ]
            assert "Address already in use" in captured.err
            assert list(tmp.iterdir()) == []
            assert _running_in(tmp) == []
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
