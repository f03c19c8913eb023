"""Reading EXPLAIN (FORMAT JSON) plans in tests of a statement's shape."""

from __future__ import annotations

from typing import Any


def scans_of(plan: dict[str, Any], relation: str) -> list[dict[str, Any]]:
    """Every node of a plan that reads ``relation``."""
    found = [plan] if plan.get("Relation Name") == relation and "Scan" in str(plan["Node Type"]) else []
    for child in plan.get("Plans", []):
        found += scans_of(child, relation)
    return found


def scans_of_partitions(plan: dict[str, Any], table: str) -> list[dict[str, Any]]:
    """Every node of a plan that reads ``table`` or one of its partitions
    (``{table}_pNNNNNN``, backhalf.housekeeping.partitions): PostgreSQL names the partition."""
    name = str(plan.get("Relation Name", ""))
    mine = name == table or (name.startswith(f"{table}_p") and name[len(table) + 2 :].isdigit())
    found = [plan] if mine and "Scan" in str(plan["Node Type"]) else []
    for child in plan.get("Plans", []):
        found += scans_of_partitions(child, table)
    return found
