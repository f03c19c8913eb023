"""Every command's --help (issue 24): what it does, an example that parses,
the environment it reads."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from ingest.cli import help_pages as help
from ingest.cli.main import _parser
from ingest.config.transports import definitions


def test_every_command_has_a_description_and_an_example() -> None:
    paths = [path for path, _, _ in help.commands(_parser())]
    assert sorted(paths) == sorted(help.EXAMPLES)
    for path, command, line in help.commands(_parser()):
        assert line, f"{path}: no one-line help"
        assert command.description == line
        assert help.EXAMPLES[path] in (command.epilog or "")


@pytest.mark.parametrize("path", sorted(help.EXAMPLES))
def test_each_example_parses_as_its_own_command(path: str) -> None:
    words = shlex.split(help.EXAMPLES[path])
    assert words[0] == "switchboard"
    args = _parser().parse_args(words[1:])
    assert args.verb == path.split()[0]


def test_the_help_pages_name_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["todos", "list", "--help"])
    page = capsys.readouterr().out
    assert "todos, newest first" in page
    assert "switchboard todos list --queue orders --status failed" in page
    for variable in ("SWITCHBOARD_CONFIG", "SWITCHBOARD_DATABASE_URL", "SWITCHBOARD_REDIS_URL"):
        assert variable in page


def test_the_top_page_names_the_environment_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    assert "SWITCHBOARD_DATABASE_URL" in capsys.readouterr().out


def test_the_top_page_names_every_transport_and_its_url_variable(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44: each transport added once forgot the help (AMQP missing from
    its top line; only the Redis variable named)."""
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = capsys.readouterr().out
    top = out.split("\n\n")[1]
    # Every registered transport, by the registration table.
    for transport in (*definitions(), "webhooks"):
        assert transport in top, top
    for variable in (
        "SWITCHBOARD_REDIS_URL",
        "SWITCHBOARD_NATS_URL",
        "SWITCHBOARD_AMQP_URL",
        "SWITCHBOARD_SQS_ENDPOINT_URL",
        *(v for d in definitions().values() for v in d.variables),
    ):
        assert variable in out


def test_the_command_imports_a_verbs_own_modules_only_when_it_runs() -> None:
    """Parsing and help import neither alembic (``migrate``'s) nor the
    acker's or the ingester's modules: every process and short command
    starts without them (about 120 modules of 830)."""
    verbs_own = ("alembic", "ingest.processes.ack.acker", "ingest.processes.pull.ingester")
    code = f"""
import contextlib, io, sys
from ingest.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    main.main(["--help"])
print(sorted(m for m in sys.modules if m.startswith({verbs_own!r})))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
