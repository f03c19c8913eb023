"""``switchboard receive``: the webhook routes, and their group commit."""
