"""The operator actions, under every front end (the CLI, the console to come).

Each action takes the engine, opens its own transaction(s), prints nothing
and returns a typed outcome: its own frozen "done" dataclass saying what
changed, or :class:`ingest.actions.outcomes.Refused` with the reason an
operator reads. A failure that is not the operator's (the database out of
reach, a bug) is raised, for the front end's boundary to explain.
"""
