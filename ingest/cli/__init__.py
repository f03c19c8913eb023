"""The ``switchboard`` command: one module per verb (``main`` parses and dispatches)."""
