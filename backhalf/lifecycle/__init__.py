"""The todo lifecycle: every write to ``todos`` and ``todo_events``, the
queues, one run of one todo, the workers' state writer and the rescuer."""
