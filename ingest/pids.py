"""A process named so that a later one given the same pid is not taken for
it: its pid and its start time (clock ticks since boot, from /proc). Used
where a folder records its owner (the workers' metrics folders, the
developer kit's server folders) and another process must tell whether
that owner still runs."""

from __future__ import annotations

from pathlib import Path


def started_at(pid: int) -> str | None:
    """The process's start time, None if it is gone or a zombie."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat_line.rpartition(")")[2].split()  # after "pid (comm)"
    return None if fields[0] == "Z" else fields[19]


def owner_tag(pid: int) -> str:
    """``"<pid> <start time>"``; ``-`` for the time of a process that is gone."""
    return f"{pid} {started_at(pid) or '-'}"
