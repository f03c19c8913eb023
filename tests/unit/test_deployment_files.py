"""The deployment files of ``ops/`` as shipped: the systemd units, the env
file example, the Dockerfile, ``.dockerignore`` and the compose file, checked
as far as a parser can (no Docker engine here): every command they run is
one the real CLI parser accepts, restarts do not spin on exits 2 and 3, no
secret is written in them, and ``systemd-analyze`` verifies the units and
rates their exposure."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from ingest.adapters.factory import transports
from ingest.adapters.redis.settings import URL_VARIABLE as REDIS_URL_VARIABLE
from ingest.cli import main as cli
from ingest.config import DATABASE_URL_VARIABLE, load
from ingest.config.webhook import resolve_secrets
from ingest.exit_codes import EXIT_CONFIG, EXIT_DATABASE
from ingest.web import server as web_server
from tests.support import yaml_subset

ROOT = Path(__file__).parents[2]
OPS = ROOT / "ops"
UNITS = OPS / "systemd"
LONG_RUNNING = (
    "switchboard-ingest@.service",
    "switchboard-ack.service",
    "switchboard-worker.service",
    "switchboard-receive.service",
    "switchboard-web.service",
)
ALL_UNITS = ("switchboard-migrate.service", *LONG_RUNNING)
VENV_SWITCHBOARD = "/opt/switchboard/.venv/bin/switchboard"
ENV_FILE = "/etc/switchboard/switchboard.env"
# Measured with systemd 252: 1.1 for every unit ("OK"; 9.2, "UNSAFE", before
# the hardening). A little room for another systemd's weights.
MAX_EXPOSURE = 1.5
HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "RestrictNamespaces": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "CapabilityBoundingSet": "",
    "UMask": "0077",
}
# Anything that looks like a credential written out: a URL with a password,
# password=..., a server's requirepass, an image's *_PASSWORD variable.
_INLINE_SECRET = re.compile(
    r"://[^/\s:@]+:[^@\s]+@|password\s*=|requirepass\s+\w|_PASSWORD\s*[:=]\s*\S", re.IGNORECASE
)


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections of a unit file, each key's values in order (a key may repeat,
    as SystemCallFilter does; configparser would keep only the last)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"{path.name}:{number}: no continuation lines, please"
        if line.startswith("["):
            assert line.endswith("]"), f"{path.name}:{number}: {line!r}"
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}:{number}: a key outside any section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}:{number}: not key=value: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service(name: str) -> dict[str, list[str]]:
    return parse_unit(UNITS / name)["Service"]


def one(section: dict[str, list[str]], key: str) -> str:
    values = section.get(key)
    assert values is not None, f"{key} missing"
    assert len(values) == 1, f"{key} given {len(values)} times: {values}"
    return values[0]


def parse_cli(argv: list[str]) -> Any:
    """The real CLI parser's reading of ``argv``: a verb or option it does not
    have exits 2, which fails the test."""
    try:
        return cli._parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"switchboard rejects {argv}: exit {exc.code}")


@pytest.mark.parametrize("name", ALL_UNITS)
def test_each_unit_runs_a_real_verb_as_the_service_user_with_the_env_file(name: str) -> None:
    svc = service(name)
    assert one(svc, "User") == "switchboard"
    assert one(svc, "Group") == "switchboard"
    expected = {
        "switchboard-migrate.service": "migrate",
        "switchboard-ingest@.service": "ingest",
        "switchboard-ack.service": "ack",
        "switchboard-worker.service": "worker",
        "switchboard-receive.service": "receive",
        "switchboard-web.service": "web",
    }[name]
    # The shared secrets, then the role's own (optional: "-"), which override them.
    assert svc["EnvironmentFile"] == [ENV_FILE, f"-/etc/switchboard/{expected}.env"]
    executable, *argv = one(svc, "ExecStart").split()
    assert executable == VENV_SWITCHBOARD
    args = parse_cli([a.replace("%H-%i", "host-1") for a in argv])
    assert args.config == "/etc/switchboard/switchboard.toml"
    assert args.verb == expected


def test_each_ingester_instance_has_a_consumer_name_of_its_own() -> None:
    """The instance (%i) with the host (%H): two instances, or two hosts, never share a name."""
    exec_start = one(service("switchboard-ingest@.service"), "ExecStart")
    assert parse_cli(exec_start.split()[1:]).consumer == "%H-%i"


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_long_running_units_stop_gracefully_and_do_not_restart_on_exit_2_or_3(name: str) -> None:
    svc = service(name)
    assert one(svc, "Type") == "exec"
    assert one(svc, "KillSignal") == "SIGTERM"
    assert one(svc, "Restart") in {"always", "on-failure"}
    assert float(one(svc, "RestartSec")) >= 1
    prevented = {int(code) for code in one(svc, "RestartPreventExitStatus").split()}
    assert {EXIT_CONFIG, EXIT_DATABASE} <= prevented
    unit = parse_unit(UNITS / name)["Unit"]
    assert "switchboard-migrate.service" in one(unit, "Requires").split()
    assert "switchboard-migrate.service" in one(unit, "After").split()


def test_stop_timeouts_cover_the_shutdown_bounds() -> None:
    """The ingester's and acker's stop waits ``shutdown_timeout_s`` for their
    loops; the worker lets a handler run out its time limit."""
    example = load(OPS / "switchboard.example.toml", {})
    for name in ("switchboard-ingest@.service", "switchboard-ack.service"):
        bound = max(example.ingest.shutdown_timeout_s, example.acker.shutdown_timeout_s)
        assert float(one(service(name), "TimeoutStopSec")) >= 2 * bound
    # The receiver answers its requests in flight (respond_within_ms), then
    # its committers get [ingest] shutdown_timeout_s.
    receive_bound = example.receiver.respond_within_ms / 1000 + example.ingest.shutdown_timeout_s
    assert float(one(service("switchboard-receive.service"), "TimeoutStopSec")) >= 1.5 * receive_bound
    # The console answers its requests in flight, then stops its process.
    assert float(one(service("switchboard-web.service"), "TimeoutStopSec")) >= 2 * (web_server.SHUTDOWN_S + 1)
    worker = service("switchboard-worker.service")
    longest_handler_s = max(q.time_limit_ms for q in example.queues.values()) / 1000
    assert float(one(worker, "TimeoutStopSec")) > longest_handler_s
    # dramatiq's main process forwards SIGTERM to its worker processes, and
    # one that gets a second SIGTERM exits at once: only the main one is signalled.
    assert one(worker, "KillMode") == "mixed"


def test_the_console_unit_listens_on_loopback_for_a_proxy() -> None:
    """A console off loopback needs a token the unit cannot know: it listens
    on loopback, behind the TLS proxy, and says which login runs it."""
    svc = service("switchboard-web.service")
    args = parse_cli(one(svc, "ExecStart").split()[1:])
    assert args.listen == "127.0.0.1:8089"
    assert not args.read_only  # the login decides; the operator's console acts
    text = (UNITS / "switchboard-web.service").read_text()
    for said in ("switchboard_operator_login", "switchboard_viewer_login", "SWITCHBOARD_WEB_TOKEN"):
        assert said in text


def test_the_http_units_leave_their_servers_every_connection_they_serve() -> None:
    """Under systemd's default soft limit (1024) the receiver would cap itself
    at fewer connections than it serves (issue 43): each HTTP unit raises it
    to cover its connections and the descriptors kept beside them."""
    from ingest.processes import http_guard
    from ingest.processes.push import receiver

    for name, connections in (
        ("switchboard-receive.service", receiver.MAX_CONNECTIONS),
        ("switchboard-web.service", web_server.MAX_CONNECTIONS),
    ):
        assert int(one(service(name), "LimitNOFILE")) >= connections + http_guard.FD_RESERVE, name


def test_the_migration_is_a_oneshot_the_others_wait_for() -> None:
    svc = service("switchboard-migrate.service")
    assert one(svc, "Type") == "oneshot"
    assert one(svc, "RemainAfterExit") == "yes"
    # A database away at boot is retried (else every unit requiring this one
    # fails with it), a config error or a permanent refusal is not.
    assert one(svc, "Restart") == "on-failure"
    assert set(one(svc, "RestartPreventExitStatus").split()) >= {"2", "3"}


@pytest.mark.parametrize("name", ALL_UNITS)
def test_each_unit_is_hardened(name: str) -> None:
    svc = service(name)
    for key, value in HARDENING.items():
        assert one(svc, key) == value, f"{name}: {key}"
    filters = svc["SystemCallFilter"]
    assert filters[0] == "@system-service"
    assert all(f.startswith("~") for f in filters[1:])


def _units_with_a_stub(tmp_path: Path) -> Path:
    """The units in a folder of their own, ExecStart pointed at an executable
    stub: ``verify`` refuses a unit whose binary does not exist here."""
    stub = tmp_path / "switchboard"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    for name in ALL_UNITS:
        text = (UNITS / name).read_text()
        assert VENV_SWITCHBOARD in text
        (tmp_path / name).write_text(text.replace(VENV_SWITCHBOARD, str(stub)))
    return tmp_path


@pytest.fixture
def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze is not installed")
    return path


def test_systemd_analyze_verifies_the_units(systemd_analyze: str, tmp_path: Path) -> None:
    folder = _units_with_a_stub(tmp_path)
    names = [*ALL_UNITS, "switchboard-ingest@1.service"]
    result = subprocess.run(
        [systemd_analyze, "verify", "--man=no", *names],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=folder,
        check=False,
    )
    # verify exits 0 on an unknown key or a value it cannot parse, and says
    # so on stderr: both count.
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize("name", ALL_UNITS)
def test_systemd_analyze_rates_the_exposure_ok(systemd_analyze: str, name: str) -> None:
    result = subprocess.run(
        [systemd_analyze, "security", "--offline=true", "--no-pager", str(UNITS / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if "--offline" in result.stderr and "unrecognized" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    assert result.returncode == 0, result.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", result.stdout)
    assert match is not None, result.stdout[-2000:]
    assert float(match[1]) <= MAX_EXPOSURE, result.stdout


def _mdwe_available() -> bool:
    """Linux 6.3+ refuses write+execute memory per process (prctl PR_SET_MDWE),
    what MemoryDenyWriteExecute=yes enforces with seccomp."""
    probe = "import ctypes, sys; sys.exit(0 if ctypes.CDLL(None).prctl(65, 1, 0, 0, 0) == 0 else 1)"
    return (
        sys.platform == "linux"
        and subprocess.run([sys.executable, "-c", probe], timeout=30, check=False).returncode == 0
    )


def test_the_processes_code_runs_with_memory_deny_write_execute() -> None:
    """Under the kernel's write-xor-execute (PR_SET_MDWE), every module of the
    processes imports and their native code runs: psycopg's libpq, hiredis,
    regex, the JSON schema checker, dramatiq's broker and prometheus-client.
    A library that needs W+X memory (a JIT, libffi closures without static
    trampolines) fails here, not in production under the unit's
    MemoryDenyWriteExecute=yes. The whole pipeline ran so as well: the
    system tests of the workers and the metrics pass under it."""
    if not _mdwe_available():
        pytest.skip("no prctl(PR_SET_MDWE) on this kernel (Linux < 6.3)")
    program = """
import ctypes, importlib, mmap, pkgutil, sys
assert ctypes.CDLL(None).prctl(65, 1, 0, 0, 0) == 0
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
except OSError:
    pass
else:
    sys.exit("W+X memory was allowed: the check proves nothing")
import backhalf, ingest, schema
for package in (ingest, backhalf, schema):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        # The embedded kit is not in production; __main__ runs the CLI;
        # worker_app builds a broker from a config when imported.
        if not info.name.startswith(
            ("ingest.embedded", "ingest.processes.workers.worker_app", "ingest.worker_app", "ingest.__main__")
        ):
            importlib.import_module(info.name)
import hiredis, psycopg, regex, jsonschema
from psycopg.pq import version
reader = hiredis.Reader(); reader.feed(b"+PONG\\r\\n"); assert reader.gets() == b"PONG"
assert regex.fullmatch(r"(?i)o+k", "oOK") and version() > 0
jsonschema.validate({"a": 1}, {"type": "object"})
import dramatiq.brokers.redis, prometheus_client
prometheus_client.generate_latest()
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_the_env_file_example_holds_placeholders_for_the_variables_the_config_reads() -> None:
    text = (UNITS / "switchboard.env.example").read_text()
    assignments = dict(
        line.split("=", 1) for line in text.splitlines() if line.strip() and not line.startswith("#")
    )
    assert {DATABASE_URL_VARIABLE, REDIS_URL_VARIABLE} <= set(assignments)
    for variable, value in assignments.items():
        assert variable.startswith("SWITCHBOARD_"), variable
        assert not value.startswith(("'", '"')), f"{variable}: systemd keeps quotes out; no quotes"
        if "://" in value:
            assert ":CHANGE-ME@" in value, f"{variable} must carry a placeholder password, not a real one"
    assert "0600" in text


# --- the image ---------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        instruction, _, args = (pending + line).partition(" ")
        out.append((instruction.upper(), " ".join(args.split())))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return out


def _installed_sources() -> set[str]:
    """The top-level folders and files ``pip install .`` reads: the packages'
    folders (mapped ones included) and the files the metadata names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    folders = {
        setuptools["package-dir"].get(p, p.replace(".", "/")).split("/")[0] for p in setuptools["packages"]
    }
    return folders | {"pyproject.toml", "constraints.txt", project["project"]["readme"]}


def test_the_dockerfile_installs_the_pinned_package_and_runs_it_as_a_non_root_user() -> None:
    steps = dockerfile_instructions(OPS / "Dockerfile")
    assert steps[0][0] == "FROM"
    # Pinned by digest (issue 32): the tag names it for readers, the digest decides.
    assert re.fullmatch(r"python:3\.1[1-9]-slim(-\w+)?@sha256:[0-9a-f]{64}", steps[0][1]), steps[0][1]
    copied = {Path(src).name for kind, args in steps if kind == "COPY" for src in args.split()[:-1]}
    assert _installed_sources() <= copied, _installed_sources() - copied
    installs = [args for kind, args in steps if kind == "RUN" and "pip install" in args]
    assert len(installs) == 1
    # The `http` extra (the webhook receiver's server), the `web` one (the
    # console's), `otel` (traces, used where OTEL_* ask) and every registered
    # transport's client, and no other: no dev, test or embedded extras.
    found = re.search(r'pip install -c constraints\.txt "\.\[([a-z,]+)\]"(\s|$)', installs[0])
    assert found, installs[0]
    extras = {t.extra for t in transports().values() if t.extra is not None}
    assert set(found.group(1).split(",")) == {"http", "web", "otel"} | extras, installs[0]
    assert installs[0].count("[") == 1, "one install of the package"
    users = [i for i, (kind, _) in enumerate(steps) if kind == "USER"]
    assert users, "no USER: the processes would run as root"
    user = steps[users[-1]][1].split(":")[0]
    assert user not in {"root", "0"}
    assert "useradd --system --gid switchboard" in " ".join(a for _, a in steps)
    assert all(kind != "RUN" for kind, _ in steps[users[-1] :]), "nothing runs as root after USER"
    entrypoints = [args for kind, args in steps if kind == "ENTRYPOINT"]
    assert [json.loads(e) for e in entrypoints] == [["switchboard"]]
    assert not any(_INLINE_SECRET.search(args) for _, args in steps)
    assert not any(kind in {"ENV", "ARG"} and "SWITCHBOARD_" in args for kind, args in steps)


def test_the_dockerignore_lets_in_only_what_the_image_copies() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "everything out first (a local switchboard.env, .venv, build/ ...)"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == _installed_sources()


# --- compose -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    parsed = yaml_subset.loads((OPS / "compose.yaml").read_text())
    assert isinstance(parsed, dict)
    return parsed


def _a_python_with_pyyaml() -> str | None:
    for candidate in ("/usr/bin/python3", shutil.which("python3")):
        if (
            candidate
            and subprocess.run(
                [candidate, "-c", "import yaml"], capture_output=True, timeout=30, check=False
            ).returncode
            == 0
        ):
            return candidate
    return None


def test_a_real_yaml_reader_reads_the_compose_file_the_same(compose: dict[str, Any]) -> None:
    """The subset reader's result is what PyYAML (where some interpreter on
    the machine has it; it is no dependency of ours) reads too."""
    python = _a_python_with_pyyaml()
    if python is None:
        pytest.skip("no interpreter here has PyYAML; the subset reader alone checked the file")
    result = subprocess.run(
        [python, "-c", "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"],
        input=(OPS / "compose.yaml").read_text(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(result.stdout) == compose


def test_the_subset_reader_refuses_what_it_does_not_understand() -> None:
    for text in ("a: &x 1\nb: *x\n", "a:\n  <<: {}\n", "a: yes\n", "a: |\n  text\n", "a: 1\na: 2\n"):
        with pytest.raises(yaml_subset.YamlSubsetError):
            yaml_subset.loads(text)


PROCESSES = {
    "migrate": "migrate",
    "ingest": "ingest",
    "ack": "ack",
    "worker": "worker",
    "receive": "receive",
    "web": "web",
}


def test_compose_runs_every_process_on_the_servers(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "valkey", *PROCESSES}
    for name, verb in PROCESSES.items():
        svc = services[name]
        assert svc["image"] == "switchboard:local"
        assert svc["build"] == {"context": "..", "dockerfile": "ops/Dockerfile"}
        assert (OPS / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        config = svc["environment"]["SWITCHBOARD_CONFIG"]
        assert svc["configs"] == [{"source": "switchboard_toml", "target": config}]
        # Each long-running process that reaches Redis with its own users'
        # file (issue 32); the workers reach PostgreSQL only (DESIGN.md 7b).
        assert svc["env_file"] == (
            "switchboard.env"
            if verb == "migrate"
            else ["switchboard.env"]
            if verb == "worker"
            else ["switchboard.env", f"secrets/{verb}.env"]
        )
        args = parse_cli(["--config", config, *svc["command"]])
        assert args.verb == verb
    assert services["migrate"]["restart"] == "no"
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    # The console reads the brokers as `status` does.
    for name in ("ingest", "ack", "web"):
        assert services[name]["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"},
            "valkey": {"condition": "service_healthy"},
        }
    # The receiver and the workers (their broker is PostgreSQL) need no Redis.
    for name in ("receive", "worker"):
        assert services[name]["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}
    assert services["postgres"]["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert "valkey-cli ping" in services["valkey"]["healthcheck"]["test"][1]
    assert services["valkey"]["secrets"] == ["valkey_conf", "redis_users"]


def test_compose_health_checks_read_each_process_healthz(compose: dict[str, Any]) -> None:
    for name in ("ingest", "ack", "worker", "receive"):
        svc = compose["services"][name]
        args = parse_cli(["--config", "x.toml", *svc["command"]])
        kind, interpreter, flag, program = svc["healthcheck"]["test"]
        assert (kind, interpreter, flag) == ("CMD", "python", "-c")
        assert f"urlopen('http://127.0.0.1:{args.metrics_port}/healthz'" in program
        compile(program, "healthcheck", "exec")  # a syntax error would only show as "unhealthy"
    # The console's own /healthz, on its listen port (no sign-in needed there).
    web = compose["services"]["web"]
    args = parse_cli(["--config", "x.toml", *web["command"]])
    kind, interpreter, flag, program = web["healthcheck"]["test"]
    assert (kind, interpreter, flag) == ("CMD", "python", "-c")
    assert f"urlopen('http://127.0.0.1:{args.listen.rsplit(':', 1)[1]}/healthz'" in program
    compile(program, "healthcheck", "exec")
    worker = compose["services"]["worker"]
    assert worker["stop_grace_period"] == "11m"


def test_compose_publishes_the_receiver_and_the_console_on_the_hosts_loopback_only(
    compose: dict[str, Any],
) -> None:
    """Plain HTTP: a TLS proxy on the host in front of them, never 0.0.0.0.
    Inside its container each listens on every address, which a published
    port needs (the console only with its token, from its own env file)."""
    services = compose["services"]
    assert services["receive"]["ports"] == ["127.0.0.1:8080:8080"]
    assert services["web"]["ports"] == ["127.0.0.1:8089:8089"]
    assert [name for name, svc in services.items() if "ports" in svc] == ["receive", "web"]
    settings = load(OPS / "compose.switchboard.toml", {})
    assert settings.receiver.listen == "0.0.0.0:8080"
    assert parse_cli(["--config", "x.toml", *services["web"]["command"]]).listen == "0.0.0.0:8089"
    assert services["web"]["env_file"] == ["switchboard.env", "secrets/web.env"]
    assert "SWITCHBOARD_WEB_TOKEN" in (OPS / "compose.yaml").read_text()


def test_compose_keeps_every_secret_in_files_outside_it(compose: dict[str, Any]) -> None:
    text = (OPS / "compose.yaml").read_text()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.lstrip().startswith("#"):
            assert not _INLINE_SECRET.search(line), f"compose.yaml:{number}: {line.strip()}"
    secrets = compose["secrets"]
    assert set(secrets) == {"postgres_password", "valkey_conf", "redis_users"}
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "ops/secrets/" in ignored
    assert "ops/switchboard.env" in ignored
    for secret in secrets.values():
        assert secret["file"].startswith("./secrets/")
    postgres = compose["services"]["postgres"]
    assert postgres["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    assert "POSTGRES_PASSWORD" not in postgres["environment"]
    assert compose["services"]["valkey"]["command"][1] == "/run/secrets/valkey_conf"


def test_the_compose_processes_config_loads_and_serves_healthz() -> None:
    """The config the containers read is valid as shipped, holds no password,
    and turns the metrics endpoint on where the health checks look."""
    path = OPS / "compose.switchboard.toml"
    assert not _INLINE_SECRET.search(path.read_text())
    settings = load(path, {})
    assert settings.metrics.port == 9464
    assert settings.metrics.address == "127.0.0.1"
    assert [a.name for a in settings.adapters] == ["orders"]
    assert set(settings.queues) == {"orders"}
    # The users of ops/redis-users.acl, from each process's own variables;
    # no dramatiq broker (the workers' is PostgreSQL), so no key of it left.
    env = {"SWITCHBOARD_BROKER_USER": "switchboard-ingester", "SWITCHBOARD_BROKER_PASSWORD": "p1"}
    full = load(path, env)
    assert full.adapters[0].broker.url() == "redis://switchboard-ingester:p1@valkey:6379/0"
    assert full.notices == ()
    acl = (OPS / "redis-users.acl").read_text()
    for user in ("switchboard-ingester", "switchboard-acker", "switchboard-producer"):
        assert f"user {user} on " in acl
    assert "switchboard-dramatiq" not in acl
    # The receiver's adapter: its secret from secrets/receive.env, read by
    # `receive` alone (every other process loads the table without it).
    (webhook,) = settings.webhooks
    assert (webhook.name, webhook.queue) == ("orders-webhook", "orders")
    assert webhook.queue in settings.queues
    secret = "whsec_" + base64.b64encode(b"0123456789abcdef").decode()
    secrets = resolve_secrets(webhook, {**env, **dict.fromkeys(webhook.secrets_env, secret)})
    assert [s.name for s in secrets] == list(webhook.secrets_env)


def test_every_registered_transports_client_is_an_install_extra_the_dev_kit_brings() -> None:
    """A transport of ingest.adapters.factory whose client is an extra names
    one that pyproject.toml declares, and the embedded kit (the demo, the
    tests) installs it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    kit = next(d for d in extras["embedded"] if d.startswith("switchboard-ingest["))
    brought = set(kit.split("[", 1)[1].rstrip("]").split(","))
    for name, transport in transports().items():
        if transport.extra is not None:
            assert transport.extra in extras, f"transport {name}: no [{transport.extra}] extra"
            assert transport.extra in brought, f"transport {name}: the embedded kit lacks [{transport.extra}]"
