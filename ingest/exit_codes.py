"""The process exit codes, named once (docs/cli.md, "Exit codes")."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1  # any other failure, including a task or thread left alive
EXIT_CONFIG = 2  # the config is invalid: a supervisor should not restart on it
# The database refuses permanently (not migrated, login refused, no such
# database): waiting does not help; the message says what to do.
EXIT_DATABASE = 3
EXIT_UNHEALTHY = 4  # `status`: some adapter is unhealthy (its broker unreachable or failing)
EXIT_FORCED = 130  # a second stop signal: the operator insisted
