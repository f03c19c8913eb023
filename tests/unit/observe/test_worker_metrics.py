"""Issue 32, item 9: the workers' metrics directory is made with mkdtemp, so
no other local user can take its name first (the fixed name per port could
be, and the worker then exited 2), and a start deletes ended runs'
directories, never a running deployment's."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ingest.config import Settings, from_mapping
from ingest.errors import ConfigError
from ingest.observe import worker_metrics
from ingest.observe.worker_metrics import MULTIPROC_VARIABLE, OWNER_FILE, prepare, remove_ended_runs
from ingest.pids import owner_tag

PORT = 9464


@pytest.fixture
def tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temp directory, for tempfile and so for prepare(): this test's own."""
    base = tmp_path / "tmp"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    return base


def _settings(port: int = PORT) -> Settings:
    return from_mapping({"database": {"url": "postgresql://u@h/d"}, "metrics": {"port": port}}, {})


def test_metrics_off_needs_no_directory(tmp_dir: Path) -> None:
    assert prepare(_settings(0)) == {}
    assert list(tmp_dir.iterdir()) == []


def test_each_start_gets_a_fresh_private_directory_of_its_own(tmp_dir: Path) -> None:
    first = Path(prepare(_settings())[MULTIPROC_VARIABLE])
    second = Path(prepare(_settings())[MULTIPROC_VARIABLE])
    assert first != second  # a new name each time, not one per port
    for path in (first, second):
        assert path.parent == tmp_dir
        assert path.name.startswith(f"{worker_metrics.MULTIPROC_PREFIX}{PORT}-")
        info = path.lstat()
        assert stat.S_ISDIR(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o700
        assert info.st_uid == os.getuid()
        # Owned by this process: `switchboard worker` execs dramatiq, keeping the pid.
        assert (path / OWNER_FILE).read_text().split()[0] == str(os.getpid())
    # The first run's owner (this process) still runs: its files stay.
    assert first.is_dir()


def test_the_old_fixed_name_taken_by_someone_else_does_not_stop_the_worker(tmp_dir: Path) -> None:
    """The old name (``switchboard-metrics-{uid}-{port}``), made first by
    another local user as a file, or as a directory of theirs under root:
    prepare() used to refuse to start (ConfigError, exit 2)."""
    squatted = tmp_dir / f"switchboard-metrics-{os.getuid()}-{PORT}"
    squatted.write_text("not yours")
    env = prepare(_settings())
    assert Path(env[MULTIPROC_VARIABLE]) != squatted
    assert squatted.read_text() == "not yours"  # left alone


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user's needs root")
def test_a_directory_of_another_users_named_like_ours_is_neither_used_nor_deleted(tmp_dir: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    theirs = tmp_dir / f"{worker_metrics.MULTIPROC_PREFIX}{PORT}-theirs"
    theirs.mkdir()
    (theirs / OWNER_FILE).write_text("999999999 -")  # an owner long gone
    os.chown(theirs / OWNER_FILE, nobody.pw_uid, nobody.pw_gid)
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    squatted = tmp_dir / f"switchboard-metrics-{os.getuid()}-{PORT}"
    squatted.mkdir()
    os.chown(squatted, nobody.pw_uid, nobody.pw_gid)
    env = prepare(_settings())
    assert Path(env[MULTIPROC_VARIABLE]) not in (theirs, squatted)
    assert theirs.is_dir()
    assert squatted.is_dir()


def _ended_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


def _run_dir(base: Path, name: str, owner: str | None) -> Path:
    path = base / f"{worker_metrics.MULTIPROC_PREFIX}{name}"
    path.mkdir(mode=0o700)
    (path / "counter_1.db").write_bytes(b"x")
    if owner is not None:
        (path / OWNER_FILE).write_text(owner)
    return path


def test_a_start_deletes_ended_runs_directories_and_no_other(tmp_dir: Path, tmp_path: Path) -> None:
    me = owner_tag(os.getpid())
    running = _run_dir(tmp_dir, "1-running", me)
    ended = _run_dir(tmp_dir, "2-ended", f"{_ended_pid()} 12345")
    # Our pid, but another start time: a later process given an ended run's pid.
    reused = _run_dir(tmp_dir, "3-reused", f"{os.getpid()} 1")
    unowned = _run_dir(tmp_dir, "4-being-set-up", None)
    garbled = _run_dir(tmp_dir, "5-garbled", "not a pid")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / OWNER_FILE).write_text(f"{_ended_pid()} 1")
    link = tmp_dir / f"{worker_metrics.MULTIPROC_PREFIX}6-link"
    link.symlink_to(outside)

    assert sorted(remove_ended_runs()) == sorted([ended, reused])
    assert not ended.exists()
    assert not reused.exists()
    for kept in (running, unowned, garbled, outside):
        assert kept.is_dir(), kept
    assert link.is_symlink()
    # prepare() does the same before it makes its own.
    dead_again = _run_dir(tmp_dir, "7-ended", f"{_ended_pid()} 1")
    fresh = Path(prepare(_settings())[MULTIPROC_VARIABLE])
    assert not dead_again.exists()
    assert fresh.is_dir()
    assert running.is_dir()


def test_a_temp_directory_that_cannot_be_written_is_a_config_error(tmp_dir: Path) -> None:
    if os.geteuid() == 0:
        shutil.rmtree(tmp_dir)
        tmp_dir.write_text("a file, not a directory")  # root writes where it likes
    else:
        tmp_dir.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"\[metrics\]: cannot make the workers' metrics"):
            prepare(_settings())
    finally:
        if tmp_dir.is_dir():
            tmp_dir.chmod(0o700)


def test_a_figures_file_being_created_does_not_fail_the_scrape(tmp_path: Path) -> None:
    """A worker process's file exists empty for a moment before its header
    is written; the scrape skips it rather than failing (a 500)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from ingest.observe.worker_metrics import SettledFilesCollector

    written = MmapedDict(str(tmp_path / "counter_1.db"))  # type: ignore[no-untyped-call]
    written.write_value(mmap_key("runs", "runs_total", [], [], "Runs."), 1.0, 0.0)  # type: ignore[no-untyped-call]
    written.close()  # type: ignore[no-untyped-call]
    (tmp_path / "counter_2.db").touch()  # the new process's, its header not yet written
    registry = CollectorRegistry()
    SettledFilesCollector(registry, str(tmp_path))
    assert b"runs_total 1.0" in generate_latest(registry)
