"""Stop signals (ingest/signals.py), in a process of their own."""

from __future__ import annotations

import subprocess
import sys

from ingest.exit_codes import EXIT_FORCED

# A stop requested and the run over: the second signal arrives during what
# comes after the loop (asyncio.run's teardown, interpreter shutdown).
AFTER_THE_LOOP = """
import asyncio, os, signal
from ingest.signals import stop_on_signals

async def main():
    stop = asyncio.Event()
    with stop_on_signals(stop):
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 10)

asyncio.run(main())
os.kill(os.getpid(), signal.{second})
print("not reached")
"""


def test_a_second_signal_after_the_loop_exits_130_not_by_the_signal() -> None:
    """Issue 11.7: the default actions came back with the loop's handlers
    removed, so the second signal killed the process (exit -15 or -2)."""
    for second in ("SIGTERM", "SIGINT"):
        result = subprocess.run(
            [sys.executable, "-c", AFTER_THE_LOOP.format(second=second)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == EXIT_FORCED, (second, result.returncode, result.stderr)
        assert "not reached" not in result.stdout
