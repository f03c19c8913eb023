"""Reading EXPLAIN (FORMAT JSON) plans in tests of a statement's shape."""

from __future__ import annotations

from typing import Any


def scans_of(plan: dict[str, Any], relation: str) -> list[dict[str, Any]]:
    """Every node of a plan that reads ``relation``."""
    found = [plan] if plan.get("Relation Name") == relation and "Scan" in str(plan["Node Type"]) else []
    for child in plan.get("Plans", []):
        found += scans_of(child, relation)
    return found
