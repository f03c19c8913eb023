"""Pull ingestion: broker adapters, the poll loop, the acker and the CLI."""
