"""What lets operators see the processes: logs, metrics, heartbeats, ``status``."""
