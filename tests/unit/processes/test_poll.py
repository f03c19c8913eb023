"""One delivery to one inbox record (ingest/processes/intake.py ``to_record``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ingest.adapters.base import Delivery
from ingest.config import from_mapping
from ingest.processes.intake import to_record


class _Broken:
    """A body check that fails in a way nobody foresaw."""

    def check(self, value: Any) -> None:
        raise RuntimeError("the validator's own bug")


def test_any_failure_to_normalize_one_message_is_its_rejection() -> None:
    """Issue 11.8: only PoisonMessage was caught, so any other exception
    crashed the batch on every delivery and max_deliveries never fired."""
    raw = {"name": "orders", "source": "orders"}
    cfg = from_mapping({"database": {"url": "postgresql://x@y/z"}, "adapters": [raw]}, {}).adapters[0]
    cfg = dataclasses.replace(cfg, body_schema=_Broken())  # type: ignore[arg-type]
    rec = to_record(Delivery("redis:orders:1-0", "1-0", body=b'{"x": 1}', ack_ref="1-0"), cfg)
    assert rec.payload is None
    assert rec.error == "normalize_failed: RuntimeError: the validator's own bug"
    assert rec.body == b'{"x": 1}'


def test_a_delivery_without_content_is_rejected_as_its_own_failure() -> None:
    """Not lost (the broker did not report it gone): an adapter's bug, which
    must neither pass as a lost message nor crash its batch."""
    raw = {"name": "orders", "source": "orders"}
    cfg = from_mapping({"database": {"url": "postgresql://x@y/z"}, "adapters": [raw]}, {}).adapters[0]
    rec = to_record(Delivery("redis:orders:1-0", "1-0", body=None, ack_ref="1-0"), cfg)
    assert rec.error == "normalize_failed: the adapter delivered no content"
    assert rec.payload is None
