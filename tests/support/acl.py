"""The least-privilege users of ops/redis-users.acl, for tests to run as."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ingest.embedded.servers import RedisServer, temp_base

ACL_USERS = Path(__file__).parents[2] / "ops" / "redis-users.acl"
PLACEHOLDER = ">CHANGE-ME"


def acl_rules(user: str, password: str) -> list[str]:
    """The rules of one user line of the file, with a real password."""
    (line,) = [x for x in ACL_USERS.read_text().splitlines() if x.startswith(f"user {user} ")]
    return [f">{password}" if rule.startswith(">") else rule for rule in line.split()[2:]]


def password_for(user: str) -> str:
    return f"pw-{user}"


def acl_file_as_shipped(target: Path) -> Path:
    """The shipped file, each user's ``>CHANGE-ME`` replaced by ``password_for``
    it and nothing else changed, at ``target``."""
    lines = []
    for line in ACL_USERS.read_text().splitlines(keepends=True):
        if line.startswith("user "):
            assert line.count(PLACEHOLDER) == 1, line
            line = line.replace(PLACEHOLDER, f">{password_for(line.split()[1])}")
        lines.append(line)
    target.write_text("".join(lines))
    return target


@contextmanager
def shipped_acl_redis() -> Iterator[RedisServer]:
    """A Valkey whose users are the shipped file's, the default user's included
    (its password the file's, as every user's: ``password_for``)."""
    base = temp_base("switchboard-acl-")
    server = RedisServer.create(
        base, aclfile=acl_file_as_shipped(base / "users.acl"), password=password_for("default")
    )
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
