"""Redis 7.0, the server Debian 12 ships (``redis-server``), for the tests
that must hold on it as well as on the suite's Valkey: fetched once with
``apt-get download`` (no root, nothing installed) and unpacked with its two
libraries under ``.venv/debian-redis``, where ``make clean`` removes it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
WHERE = ROOT / ".venv" / "debian-redis"
PACKAGES = ("redis-tools", "liblzf1", "libjemalloc2")
TIMEOUT_S = 300


class Unavailable(RuntimeError):
    """apt-get could not fetch the packages: the test cannot run here."""


def redis_70() -> tuple[Path, dict[str, str]]:
    """The ``redis-server`` binary (Debian's is redis-check-rdb under that
    name) and the environment it needs (its libraries' directory)."""
    binary = WHERE / "root" / "usr" / "bin" / "redis-server"
    libraries = WHERE / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    if not binary.exists():
        _fetch(binary)
    env = {**os.environ, "LD_LIBRARY_PATH": str(libraries)}
    return binary, env


def _fetch(binary: Path) -> None:
    apt_get, dpkg_deb = shutil.which("apt-get"), shutil.which("dpkg-deb")
    if apt_get is None or dpkg_deb is None:
        raise Unavailable("no apt-get and dpkg-deb here: Debian's Redis 7.0 cannot be fetched")
    downloads = WHERE / "debs"
    downloads.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run(
        [apt_get, "download", *PACKAGES], cwd=downloads, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if fetched.returncode != 0:
        raise Unavailable(f"apt-get download {' '.join(PACKAGES)} failed: {fetched.stderr.strip()[-300:]}")
    for deb in sorted(downloads.glob("*.deb")):
        subprocess.run([dpkg_deb, "-x", str(deb), str(WHERE / "root")], check=True, timeout=TIMEOUT_S)
    binary.symlink_to("redis-check-rdb")
