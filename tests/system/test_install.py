"""The installed ``switchboard`` beside PyPI's ``schema`` library, which has the
same top-level package name: detected at start-up, one line, exit 2.

The first test plants a stand-in ``schema`` earlier on ``sys.path``; the
second really installs PyPI's ``schema`` into a throwaway environment with
the wheel (``--no-deps``: the check runs before anything needs a dependency),
then uninstalls it, as issue 13 describes. ``make wheel-check`` covers the
wheel with its dependencies against real servers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ingest.exit_codes import EXIT_CONFIG

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
PYPI_SCHEMA = "schema==0.7.8"
TIMEOUT_S = 120
REPAIR = "pip install --force-reinstall --no-deps <the Switchboard wheel or clone you installed from>"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def _one_line_exit_2(argv: list[str], *, cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet", *args],
        check=True,
        timeout=TIMEOUT_S,
        capture_output=True,
    )


@pytest.mark.parametrize("argv", [["--version"], ["migrate"], ["status", "--json"]])
def test_a_foreign_schema_first_on_sys_path_is_one_line(tmp_path: Path, argv: list[str]) -> None:
    fake = tmp_path / "path" / "schema"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('"""A stand-in for PyPI\'s schema library."""\n\nclass Schema: ...\n')
    env = _env(PYTHONPATH=str(tmp_path / "path"), SWITCHBOARD_DATABASE_URL="postgresql://u@127.0.0.1:1/x")
    line = _one_line_exit_2([sys.executable, "-m", "ingest", *argv], cwd=tmp_path, env=env)
    assert line.startswith(
        f"switchboard: the package 'schema' at {fake / '__init__.py'} is not Switchboard's"
    )
    assert "found earlier on sys.path" in line
    assert "pip uninstall schema" in line
    assert REPAIR in line


def test_pypi_schema_installed_beside_the_wheel_then_uninstalled(tmp_path: Path) -> None:
    _pip("wheel", "--no-deps", str(ROOT), "-w", str(tmp_path / "dist"))
    (wheel,) = (tmp_path / "dist").glob("switchboard_ingest-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT_S)
    python = str(venv / "bin" / "python")
    switchboard = [str(venv / "bin" / "switchboard"), "status"]
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    _pip("--python", python, "install", "--no-deps", str(wheel))
    # Last install wins: PyPI's schema/__init__.py replaces Switchboard's, and pip says nothing.
    _pip("--python", python, "install", "--no-deps", PYPI_SCHEMA)
    line = _one_line_exit_2(switchboard, cwd=Path("/"), env=_env())
    assert line.startswith(f"switchboard: the package 'schema' at {site / 'schema' / '__init__.py'}")
    assert "installed by the distribution 'schema'" in line
    assert "pip uninstall schema" in line
    assert REPAIR in line

    # Uninstalling it deletes that file, which was Switchboard's too.
    _pip("--python", python, "uninstall", "--yes", "schema")
    line = _one_line_exit_2(switchboard, cwd=Path("/"), env=_env())
    assert line == (
        f"switchboard: Switchboard's schema/__init__.py is missing from {site / 'schema'} "
        "(uninstalling PyPI's 'schema' library, which uses the same package name, deletes it); "
        f"repair the install: {REPAIR}"
    )

    # Repaired (without its dependencies, in this throwaway environment): the
    # package is Switchboard's again, and what it cannot import is named.
    _pip("--python", python, "install", "--no-deps", "--force-reinstall", str(wheel))
    line = _one_line_exit_2(switchboard, cwd=Path("/"), env=_env())
    assert line.startswith("switchboard: cannot import Switchboard's package 'schema' (No module named ")
