"""Housekeeping: migrations, the history's partitions, retention, and the
processes' heartbeat rows."""
