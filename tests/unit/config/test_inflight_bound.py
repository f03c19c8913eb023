"""The default ``[ingest] max_inflight_bytes`` against what it costs in RSS
(issue 23; docs/operating.md, "Memory is bounded by bytes").

The bound counts message bytes as read. Measured with ``switchboard ingest``
draining a backlog of 1 MiB messages on one stream adapter, peak RSS is about
IDLE_AND_STORE_MIB + k x the bound, k the RSS each byte held costs: about 2
for ASCII JSON bodies (434 MiB at 128 MiB; 1,181 MiB at 512 MiB), 3 for field
maps (562 MiB at 128 MiB), 6.2 for bodies holding one character outside the
Basic Multilingual Plane (945 MiB at 128 MiB, 3,326 MiB at 512 MiB): Python
keeps that text at 4 bytes a character. The old default, 512 MiB, took a 2
GiB host down with such a backlog."""

from __future__ import annotations

from pathlib import Path

from backhalf.writes.normalize import DEFAULT_MAX_MESSAGE_BYTES
from ingest.config import IngestSettings

MIB = 1024 * 1024
ROOT = Path(__file__).parents[3]

IDLE_AND_STORE_MIB = 160  # the idle process (86 MiB) and the store transactions' copies
WORST_RSS_PER_BYTE_HELD = 6.2  # text outside the BMP, the worst case measured
# A 2 GiB host runs the system, `ack` (87 MiB) and `worker` (two processes,
# 211-224 MiB) beside the ingester: half of it is the ingester's.
INGESTER_SHARE_MIB = 1024


def test_the_default_bound_keeps_an_adapters_backlog_within_half_of_a_2_gib_host() -> None:
    bound_mib = IngestSettings().max_inflight_bytes / MIB
    worst_mib = IDLE_AND_STORE_MIB + WORST_RSS_PER_BYTE_HELD * bound_mib
    assert worst_mib <= INGESTER_SHARE_MIB, (
        f"{bound_mib:.0f} MiB in flight may take {worst_mib:.0f} MiB of RSS"
    )


def test_the_default_bound_reads_whole_messages_at_the_default_size_limit() -> None:
    """Reads are sized at max_message_bytes a message: the default lets each
    ask for a number of them (128), not only one at a time."""
    reads = IngestSettings().max_inflight_bytes // DEFAULT_MAX_MESSAGE_BYTES
    assert reads == 128


def test_the_docs_and_the_example_config_state_the_default() -> None:
    default = IngestSettings().max_inflight_bytes
    example = ROOT / "ops" / "switchboard.example.toml"
    (line,) = [x for x in example.read_text().splitlines() if x.startswith("max_inflight_bytes")]
    assert line.split("=")[1].split("#")[0].strip() == str(default)
    reference = ROOT / "docs" / "configuration.md"
    (row,) = [x for x in reference.read_text().splitlines() if x.startswith("| `max_inflight_bytes`")]
    assert f"| {default} ({default // MIB} MiB) |" in row
    operating = (ROOT / "docs" / "operating.md").read_text()
    assert f"`[ingest] max_inflight_bytes` ({default // MIB} MiB)" in operating
