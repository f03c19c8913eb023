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
