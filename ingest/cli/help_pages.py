"""Every command's ``--help`` page: one line of what it does (the line the
parent's list shows), its options (argparse's), an example, and the
environment it reads.

Kept here, for every command at once, rather than beside each parser: the
examples are checked against the real parser by a test (an example that no
longer parses fails it), and a command added without one fails it too.
"""

from __future__ import annotations

import argparse

from ingest.config import (
    DATABASE_URL_VARIABLE,
    DEFAULT_CONFIG_PATH,
    METRICS_PORT_VARIABLE,
)
from ingest.config.transports import definitions

# One example per command, by its path (its words after `switchboard`).
EXAMPLES: dict[str, str] = {
    "migrate": "switchboard --config switchboard.toml migrate",
    "ingest": "switchboard ingest --consumer ingest-1 --metrics-port 9464",
    "ack": "switchboard ack --metrics-port 9465",
    "receive": "switchboard receive --listen 127.0.0.1:8080 --metrics-port 9467",
    "adapters": "switchboard adapters list",
    "adapters list": "switchboard adapters list",
    "adapters enable": "switchboard adapters enable orders",
    "adapters disable": "switchboard adapters disable orders",
    "inbox": "switchboard inbox list --rejected",
    "inbox list": "switchboard inbox list --adapter orders --rejected --limit 20",
    "inbox show": "switchboard inbox show 42",
    "inbox replay": "switchboard inbox replay --adapter orders --dry-run",
    "worker": "switchboard worker --processes 2 --threads 8",
    "todos": "switchboard todos list --status failed",
    "todos list": "switchboard todos list --queue orders --status failed",
    "todos show": "switchboard todos show 7",
    "todos retry": "switchboard todos retry 7 8",
    "todos cancel": "switchboard todos cancel 9",
    "trace": "switchboard trace redis:orders:1700000000000-0",
    "prune": "switchboard prune --dry-run",
    "status": "switchboard status --json",
    # Loopback, behind a TLS proxy: never a bare 0.0.0.0 (the console speaks plain HTTP).
    "web": "switchboard web --listen 127.0.0.1:8089 --metrics-port 9468",
    "demo": "switchboard demo --messages 1000",
}

_ENVIRONMENT_TEMPLATE = f"""\
environment:
  SWITCHBOARD_CONFIG            the config file, when --config is not given (default {DEFAULT_CONFIG_PATH})
  {DATABASE_URL_VARIABLE:<29} the database URL, over [database] url
{{transports}}
  {METRICS_PORT_VARIABLE:<29} the metrics port of the long-running processes, over [metrics] port
  SWITCHBOARD_WEB_TOKEN         `web`: the console's sign-in token (without it: loopback only)
  OTEL_EXPORTER_OTLP_ENDPOINT   traces of ingest, receive and worker to this OTLP/HTTP endpoint (the otel
                                extra; every OTEL_* variable applies: docs/operating.md, "Traces")
  and the variables the config's username_env, password_env and secrets_env name"""


def _transport_variables() -> str:
    """Each registered transport's variables, one line each."""
    return "\n".join(
        f"  {variable:<29} {what}" for d in definitions().values() for variable, what in d.variables.items()
    )


_ENVIRONMENT = _ENVIRONMENT_TEMPLATE.replace("{transports}", _transport_variables())

# `demo` runs on embedded defaults: it reads none of them.
_NO_ENVIRONMENT = frozenset({"demo"})


def describe(parser: argparse.ArgumentParser) -> None:
    """Give every command under ``parser`` its description, example and
    environment, from the one-line help it was added with; and ``parser``
    itself the environment."""
    parser.epilog = _ENVIRONMENT
    for path, command, line in commands(parser):
        command.description = command.description or line
        command.formatter_class = argparse.RawDescriptionHelpFormatter
        environment = "" if path.split()[0] in _NO_ENVIRONMENT else f"\n\n{_ENVIRONMENT}"
        command.epilog = f"example:\n  {EXAMPLES[path]}{environment}"


def commands(
    parser: argparse.ArgumentParser, path: str = ""
) -> list[tuple[str, argparse.ArgumentParser, str | None]]:
    """Every command under ``parser``: (its path, its parser, its one line)."""
    found: list[tuple[str, argparse.ArgumentParser, str | None]] = []
    for action in parser._actions:  # argparse keeps its subparsers nowhere public
        if not isinstance(action, argparse._SubParsersAction):
            continue
        lines = {choice.dest: choice.help for choice in action._choices_actions}
        for name, command in action.choices.items():
            where = f"{path} {name}".strip()
            found.append((where, command, lines.get(name)))
            found += commands(command, where)
    return found
