"""``switchboard demo``: the whole pipeline on embedded servers prints its story
and OK (ingest/embedded/demo.py)."""

from __future__ import annotations

import pytest

from tests.support.processes import switchboard

pytestmark = pytest.mark.system


def test_demo_runs_the_whole_pipeline_on_embedded_servers() -> None:
    result = switchboard("demo", "--messages", "600", timeout_s=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "duplicates              0" in result.stdout
    assert "messages produced       600" in result.stdout
    assert "todos created           600" in result.stdout
    assert "OK: no loss, no duplicate" in result.stdout


def test_demo_ignores_the_callers_switchboard_environment() -> None:
    """A user who exported SWITCHBOARD_DATABASE_URL for production (as the
    README's "Running it" does) and runs the demo: its processes use the
    demo's own servers, never the database or Redis the environment names."""
    elsewhere = {
        "SWITCHBOARD_DATABASE_URL": "postgresql://someone@127.0.0.1:1/production",
        "SWITCHBOARD_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    result = switchboard("demo", "--messages", "200", env=elsewhere, timeout_s=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "todos created           200" in result.stdout
    assert "OK: no loss, no duplicate" in result.stdout
