"""Which role's login runs each command (issue 24): what a refused privilege
is explained with."""

from __future__ import annotations

from ingest.cli import help_pages, roles
from ingest.cli.main import _parser


def test_every_command_that_reaches_the_database_names_its_role() -> None:
    for path, _, _ in help_pages.commands(_parser()):
        if path in ("demo", "adapters", "inbox", "todos"):  # embedded servers; groups of actions
            continue
        words = help_pages.EXAMPLES[path].split()[1:]
        args = _parser().parse_args(words)
        assert roles.command_path(args) == path
        hint = roles.role_hint(args)
        assert hint is not None, path
        assert hint.startswith(f"`switchboard {path}` runs as the ")


def test_the_operator_commands_name_the_operator() -> None:
    for command in (["adapters", "disable", "x"], ["todos", "retry", "1"], ["inbox", "replay", "1"]):
        hint = roles.role_hint(_parser().parse_args(command))
        assert hint is not None
        assert "the operator's login" in hint
