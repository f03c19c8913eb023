"""Redis stream helpers for tests: produce entries, read the group's state."""

from __future__ import annotations

import redis


def produce(redis_url: str, stream: str, n: int, start: int = 0) -> list[str]:
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        pipe = r.pipeline(transaction=False)
        for i in range(start, start + n):
            pipe.xadd(stream, {"body": f'{{"n": {i}}}'})
        return [i.decode() for i in pipe.execute()]


def xpending(redis_url: str, stream: str, group: str = "switchboard") -> int:
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        return int(r.xpending(stream, group)["pending"])


def entries_read(redis_url: str, stream: str, group: str = "switchboard") -> int:
    """How many entries the group has delivered (XINFO GROUPS entries-read)."""
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        (info,) = [g for g in r.xinfo_groups(stream) if g["name"].decode() == group]
        return int(info["entries-read"])
