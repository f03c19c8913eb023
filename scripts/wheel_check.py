"""``make wheel-check``: the wheel as a user installs it, against real servers.

The Makefile builds the wheel and installs it into a fresh virtual environment
with the constraints file; this script, run by the development environment's
Python (it needs the embedded servers, the ``embedded`` extra), then checks:

1. The wheel holds every module and data file of the source tree: the
   packages with their ``.sql`` and ``.lua`` files, every file of the
   console's ``templates/`` and ``static/`` folders (its pages, CSS, JS and
   vendored libraries), and the top-level ``alembic/`` folder as
   ``backhalf/_migrations``; and nothing at its top level but ``ingest``,
   ``backhalf`` and ``schema`` (no ``alembic``, the library's name).
2. From outside the clone (cwd ``/``, no ``PYTHONPATH``, no ``SWITCHBOARD_*``
   variables), the wheel's own ``switchboard`` imports from its environment,
   prints its version, and runs ``migrate``, then ``ingest`` and ``ack`` on
   embedded PostgreSQL and Valkey until a few stream entries are todos and
   acked, then ``status`` (exit 0), then SIGTERM to ``ingest`` and ``ack``
   (exit 0 each).

Every wait is bounded; children are killed on any failure. Exit 0 on
success, 1 with the reason and the processes' log tails otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import psycopg
import redis

from backhalf.db import libpq_url
from ingest.embedded.config import write_config
from ingest.embedded.processes import SwitchboardProcess, wait_for
from ingest.embedded.servers import embedded_servers

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ingest", "backhalf", "schema")
SHIPPED_SUFFIXES = {".py", ".sql", ".lua"}
# Folders whose every file ships, whatever its suffix: the console's.
SHIPPED_FOLDERS = ("ingest/web/templates", "ingest/web/static")
MIGRATIONS = ("alembic", "backhalf/_migrations")  # source folder, its place in the wheel
MIGRATION_SUFFIXES = {".py", ".mako"}
DISTRIBUTION = "switchboard-ingest"

MESSAGES = 20
STREAM = "orders"
COMMAND_TIMEOUT_S = 60.0
PIPELINE_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0


class CheckFailed(Exception):
    pass


def expected_files() -> set[str]:
    """Every file of the source tree that the wheel must carry, as its path in the wheel."""
    files = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            if path.suffix in SHIPPED_SUFFIXES and "__pycache__" not in path.parts:
                files.add(path.relative_to(ROOT).as_posix())
    for folder in SHIPPED_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and not path.name.startswith(".") and "__pycache__" not in path.parts:
                files.add(path.relative_to(ROOT).as_posix())
    source, target = MIGRATIONS
    for path in (ROOT / source).rglob("*"):
        if path.suffix in MIGRATION_SUFFIXES and "__pycache__" not in path.parts:
            files.add(f"{target}/{path.relative_to(ROOT / source).as_posix()}")
    return files


def check_contents(wheel: Path) -> tuple[int, str]:
    """The number of files in the wheel and its version."""
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        fields = dict(
            line.split(": ", 1) for line in whl.read(metadata).decode().splitlines() if ": " in line
        )
    if fields.get("Name") != DISTRIBUTION:
        raise CheckFailed(f"the wheel's distribution is {fields.get('Name')!r}, not {DISTRIBUTION!r}")
    missing = sorted(expected_files() - names)
    if missing:
        raise CheckFailed(
            f"not in the wheel: {', '.join(missing)} (a package missing from [tool.setuptools] "
            "packages, or a data file from package-data, in pyproject.toml)"
        )
    extra = sorted(n for n in names - expected_files() if ".dist-info/" not in n)
    if extra:
        raise CheckFailed(
            f"in the wheel but not in the source tree: {', '.join(extra)} (left over from an earlier "
            "build in build/lib?)"
        )
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    if top != set(PACKAGES):
        raise CheckFailed(f"the wheel's top-level names are {sorted(top)}, expected {sorted(PACKAGES)}")
    return len(names), fields["Version"]


class Wheel:
    """The wheel's environment, driven from outside the clone."""

    def __init__(self, venv: Path, work: Path) -> None:
        self.venv = venv
        self.work = work
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_") and k != "PYTHONPATH"
        }
        self.running: list[SwitchboardProcess] = []

    def run(self, *argv: str, binary: str = "switchboard") -> str:
        proc = subprocess.run(  # noqa: S603 - the wheel's own binaries
            [str(self.venv / "bin" / binary), *argv],
            cwd="/",
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            raise CheckFailed(
                f"{binary} {' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
            )
        return proc.stdout

    def start(self, verb: str, config: Path) -> SwitchboardProcess:
        """``switchboard --config CONFIG VERB`` of the wheel, from ``/``, by the kit's driver."""
        proc = SwitchboardProcess(
            verb,
            config,
            self.work / f"{verb}.log",
            command=[str(self.venv / "bin" / "switchboard")],
            cwd=Path("/"),
            drop_env=("PYTHONPATH",),
        )
        self.running.append(proc)
        return proc

    def check_alive(self) -> None:
        for proc in self.running:
            if not proc.alive():
                raise CheckFailed(
                    f"switchboard {proc.verb} exited {proc.proc.returncode} while it should be running"
                )

    def stop_all(self) -> dict[str, int]:
        """Stop every process (SIGTERM, SIGKILL if it outlives the wait); each one's exit code."""
        return {proc.verb: proc.stop(STOP_TIMEOUT_S) for proc in self.running}

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for proc in self.running:
            tail = proc.raw_log().splitlines()[-lines:]
            out.append(f"--- {proc.verb} ({proc.log_path}) ---\n" + "\n".join(tail))
        return "\n".join(out)


def check_imports(wheel: Wheel) -> None:
    probe = (
        "import json, ingest, backhalf.housekeeping.migrate as m; "
        "print(json.dumps([ingest.__file__, str(m.script_location())]))"
    )
    module, migrations = json.loads(wheel.run("-c", probe, binary="python"))
    for path in (module, migrations):
        if not Path(path).resolve().is_relative_to(wheel.venv):
            raise CheckFailed(f"the wheel's environment imports {path}, outside itself")


def _scalar(db: psycopg.Connection[Any], query: str) -> int:
    row = db.execute(query).fetchone()
    return int(row[0]) if row else 0


def _all_acked(wheel: Wheel, db: psycopg.Connection[Any]) -> bool:
    wheel.check_alive()
    todos = _scalar(db, "SELECT count(*) FROM todos")
    return todos == MESSAGES == _scalar(db, "SELECT count(*) FROM inbox WHERE ack_state = 'acked'")


def check_servers(wheel: Wheel, version: str) -> dict[str, float]:
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    with embedded_servers("switchboard-wheel-check-") as servers:
        timings["servers_s"] = time.monotonic() - t0
        db_url = servers.postgres.create_database("switchboard")
        config = write_config(
            servers.base / "switchboard.toml",
            database_url=db_url,
            redis_url=servers.redis.url,
            adapters=[
                {
                    "name": "orders",
                    "transport": "redis",
                    "mode": "stream",
                    "source": STREAM,
                    "group": "switchboard",
                    "block_ms": 200,
                }
            ],
        )
        printed = wheel.run("--version").strip()
        if printed != f"switchboard {version}":
            raise CheckFailed(f"switchboard --version printed {printed!r}, expected 'switchboard {version}'")
        t1 = time.monotonic()
        wheel.run("--config", str(config), "migrate")
        timings["migrate_s"] = time.monotonic() - t1
        t2 = time.monotonic()
        wheel.start("ingest", config)
        wheel.start("ack", config)
        try:
            r = redis.Redis.from_url(servers.redis.url, socket_timeout=10)
            for i in range(MESSAGES):
                r.xadd(STREAM, {"body": json.dumps({"order_id": i})})
            with psycopg.connect(libpq_url(db_url), autocommit=True, connect_timeout=10) as db:
                wait_for(
                    lambda: _all_acked(wheel, db),
                    timeout_s=PIPELINE_TIMEOUT_S,
                    what=f"{MESSAGES} todos, acked",
                )
            wait_for(
                lambda: r.xpending(STREAM, "switchboard")["pending"] == 0,
                timeout_s=PIPELINE_TIMEOUT_S,
                what="an empty PEL",
            )
            timings["pipeline_s"] = time.monotonic() - t2
            wheel.run("--config", str(config), "status")
        except BaseException:
            wheel.stop_all()
            raise
        codes = wheel.stop_all()
        if any(codes.values()):
            raise CheckFailed(f"exit codes after SIGTERM: {codes} (expected 0 each)")
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, required=True)
    parser.add_argument("--venv", type=Path, required=True, help="the virtual environment the wheel is in")
    args = parser.parse_args()
    # A stop (make's timeout, Ctrl-C) unwinds through the clean-ups: the
    # processes are stopped and the servers' folders deleted.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    started = time.monotonic()
    wheel = Wheel(args.venv.resolve(), args.venv.resolve().parent)
    try:
        files, version = check_contents(args.wheel)
        check_imports(wheel)
        timings = check_servers(wheel, version)
    except (CheckFailed, TimeoutError, subprocess.TimeoutExpired) as exc:
        print(f"wheel-check: FAILED: {exc}", file=sys.stderr)
        if wheel.running:
            print(wheel.log_tails(), file=sys.stderr)
        return 1
    figures = ", ".join(f"{k} {v:.1f}" for k, v in timings.items())
    print(
        f"wheel-check: {args.wheel.name} ({files} files) from outside the clone: migrate, ingest, ack "
        f"({MESSAGES} entries to todos, acked, SIGTERM exit 0) and status pass ({figures}; "
        f"{time.monotonic() - started:.1f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
