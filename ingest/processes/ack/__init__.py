"""``switchboard ack``: the acker, its rescuer, retention and partitions."""
