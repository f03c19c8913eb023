"""The read models: what the CLI, the console and ``status`` show, one
module per kind of row (the inbox, the todos, the trail, the audit views,
the console's figures, the backlog). Reads only."""
