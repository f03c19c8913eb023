"""Failpoint parsing and firing (the fault battery's hooks)."""

from __future__ import annotations

import pytest

from backhalf import failpoints
from backhalf.errors import InjectedFault


def test_failpoint_spec_parsing_and_firing() -> None:
    assert failpoints.parse("after_read=kill@3, before_commit=raise, before_store=stop~CRASH") == {
        "after_read": ("kill", 3, None),
        "before_commit": ("raise", None, None),
        "before_store": ("stop", None, b"CRASH"),
    }
    for bad in ("nowhere=kill", "after_read=explode", "after_read=raise@x", "after_read"):
        with pytest.raises(ValueError, match="failpoint"):
            failpoints.parse(bad)
    failpoints.configure("before_commit=raise@2")
    try:
        failpoints.hit("before_commit")
        with pytest.raises(InjectedFault):
            failpoints.hit("before_commit")
        failpoints.hit("before_commit")  # only the 2nd hit fires
    finally:
        failpoints.configure("")
