"""``switchboard worker``: the workers over the ``todos`` table."""
