"""The least-privilege ACL users of ops/redis-users.acl suffice for the list
and pub/sub modes (the stream mode: tests/integration/processes/test_pipeline_in_process.py;
the file loaded as an aclfile, every mode in real processes:
tests/system/test_ops_examples.py)."""

from __future__ import annotations

import pytest
import redis

from ingest.adapters.redis.lists import processing_key
from tests.support.acl import acl_rules
from tests.support.db import scalar
from tests.support.in_process import pipeline, settings, wait_until
from tests.support.servers import as_redis_user


@pytest.mark.parametrize("mode", ["list", "pubsub"])
async def test_least_privilege_acl_users_suffice(
    mode: str, db_url: str, redis_url: str, r: redis.Redis
) -> None:
    source = "jobs" if mode == "list" else "notifications"  # the names ops/redis-users.acl grants
    r.execute_command("ACL", "SETUSER", "least", *acl_rules(f"switchboard-{mode}", "pw"))  # type: ignore[no-untyped-call]
    try:
        url = as_redis_user(redis_url, "least", "pw")
        adapter = {"name": source, "mode": mode, "source": source, "url": url, "block_ms": 100,
                   "consumer": "c1", "reap_interval_ms": 100}  # fmt: skip
        if mode == "pubsub":
            adapter["delivery"] = "at-most-once"
            adapter.pop("reap_interval_ms")
        else:
            r.lpush(source, b'{"job": 1}')
        async with pipeline(settings(db_url, redis_url, adapter)):
            if mode == "pubsub":
                await wait_until(lambda: r.pubsub_numsub(source)[0][1] == 1)
                r.publish(source, b'{"job": 1}')
            await wait_until(lambda: scalar(db_url, "SELECT count(*) FROM todos") == 1)
            if mode == "list":
                await wait_until(lambda: r.llen(processing_key(source, "c1")) == 0)
        assert scalar(db_url, "SELECT verify_detail FROM events") == "redis acl: least"
    finally:
        r.acl_deluser("least")
