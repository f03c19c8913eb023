"""``switchboard ingest``: a poll loop per pull adapter, its commits under way."""
