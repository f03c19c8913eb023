"""The console entry point: stop signals are caught before the heavy imports.

SQLAlchemy, a broker's client and psycopg take a good part of a second to import. A
SIGTERM in that window (a supervisor stopping a process it just started)
would otherwise kill it with the default action; here it is recorded and the
process exits 0 as soon as its loop starts, like any other graceful stop.
``python -m ingest`` and the ``switchboard`` script both come through here.

Then, before anything uses it, the top-level package ``schema`` is checked to
be Switchboard's: PyPI's ``schema`` library has the same import name, and
installed beside Switchboard it replaces ``schema/__init__.py`` (uninstalling
it deletes the file). That is one line and exit 2, not a traceback from deep
inside the first import that needs a table.
"""

from __future__ import annotations

import sys

from ingest import signals
from ingest.exit_codes import EXIT_CONFIG

DISTRIBUTION = "switchboard-ingest"
# From the wheel or clone Switchboard came from: it is not published on PyPI,
# so the bare name would fetch whatever project holds it there.
REPAIR = "pip install --force-reinstall --no-deps <the Switchboard wheel or clone you installed from>"


def main() -> int:
    signals.record_early()
    conflict = schema_conflict()
    if conflict is not None:
        print(f"switchboard: {conflict}", file=sys.stderr)
        return EXIT_CONFIG
    from ingest.cli.main import main as cli_main

    return cli_main()


def schema_conflict() -> str | None:
    """One line naming the conflict if ``import schema`` does not give Switchboard's package, else None."""
    try:
        import schema
    except ImportError as exc:
        return f"cannot import Switchboard's package 'schema' ({exc}); repair the install: {REPAIR}"
    if getattr(schema, "SWITCHBOARD_SCHEMA", False) is True:
        return None
    location = getattr(schema, "__file__", None)
    if location is None:  # a namespace package: the folder without its __init__.py
        folders = ", ".join(getattr(schema, "__path__", None) or ["?"])
        return (
            f"Switchboard's schema/__init__.py is missing from {folders} (uninstalling PyPI's 'schema' "
            f"library, which uses the same package name, deletes it); repair the install: {REPAIR}"
        )
    others = _other_distributions("schema")
    by = f"installed by the distribution {others}" if others else "found earlier on sys.path"
    return (
        f"the package 'schema' at {location} is not Switchboard's ({by}; PyPI's 'schema' library uses "
        f"the same package name): give Switchboard a virtual environment of its own, or remove the other "
        f"package (pip uninstall schema) and then repair Switchboard: {REPAIR}"
    )


def _other_distributions(package: str) -> str:
    from importlib.metadata import packages_distributions

    names = sorted(set(packages_distributions().get(package, ())) - {DISTRIBUTION})
    return ", ".join(repr(n) for n in names)
