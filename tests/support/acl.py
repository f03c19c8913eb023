"""The least-privilege users of ops/redis-acl.example, for tests to run as."""

from __future__ import annotations

from pathlib import Path

ACL_EXAMPLE = Path(__file__).parents[2] / "ops" / "redis-acl.example"


def acl_rules(user: str, password: str) -> list[str]:
    """The rules of one user line of the example, with a real password."""
    (line,) = [x for x in ACL_EXAMPLE.read_text().splitlines() if x.startswith(f"user {user} ")]
    return [f">{password}" if rule.startswith(">") else rule for rule in line.split()[2:]]
