"""Transports are loaded by name, when an adapter uses one; a missing client
is one config error naming the install extra; an intent reads in its
transport's words, and plainly where the transport is unknown."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ingest.adapters import factory
from ingest.adapters.base import AckIntentView
from ingest.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_a_transport_whose_client_is_missing_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = {
        **factory.transports(),
        "nats": factory.Transport("ingest.adapters.no_client_here", extra="nats"),
    }
    monkeypatch.setattr(factory, "transports", lambda: missing)
    with pytest.raises(ConfigError) as raised:
        factory.transport("nats", adapter="events")
    message = str(raised.value)
    assert message.startswith("adapter 'events': transport 'nats' needs its client library")
    assert "pip install 'switchboard-ingest[nats]'" in message
    assert "\n" not in message


def test_an_unknown_transport_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(
        ConfigError,
        match=r"adapter 'x': key 'transport' = 'kafka' is not one of \['amqp', 'nats', 'redis', 'sqs'\]",
    ):
        factory.transport("kafka", adapter="x")


def test_only_the_transport_an_adapter_uses_is_imported() -> None:
    """In a fresh interpreter: reading a config of every transport imports
    no broker client (each transport's settings are client-free), and the
    factory imports a transport's modes, on its client, only when asked."""
    program = (
        "import sys\n"
        "import ingest.adapters.factory as f\n"
        "from ingest.config import read_adapter\n"
        "for t in ('nats', 'sqs', 'amqp'):\n"
        "    read_adapter({'name': t, 'transport': t, 'source': 'q'}, 'redis://127.0.0.1:1/0')\n"
        "loaded = {'nats', 'aiobotocore', 'aio_pika'} & set(sys.modules)\n"
        "assert not loaded, f'a config read imported {loaded}'\n"
        "assert 'ingest.adapters.redis.modes' not in sys.modules, 'imported before use'\n"
        "f.transport('redis')\n"
        "assert 'ingest.adapters.redis.modes' in sys.modules\n"
        "assert 'nats' not in sys.modules, 'a Redis deployment imported nats-py'\n"
        "f.transport('nats')\n"
        "assert 'nats' in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_an_intent_reads_in_its_transports_words() -> None:
    stream = AckIntentView("xack", "orders", "switchboard", "1-0", 1)
    assert factory.describe_ack("redis", stream) == "XACK orders switchboard 1-0"
    assert factory.describe_ack("redis", AckIntentView("lrem", "jobs:processing:c1", None, None, 2)) == (
        "LREM jobs:processing:c1 2 <body>"
    )
    # A row whose adapter is registered no more: the kind's own transport says it.
    assert factory.describe_ack(None, stream) == "XACK orders switchboard 1-0"
    assert factory.describe_ack(None, AckIntentView("shiny", "k", None, "r", 1)) == "shiny k - r"
    reply = "$JS.ACK.ORDERS.switchboard.1.7.7.1796221376233174239.0"
    assert factory.describe_ack(None, AckIntentView("jsack", "ORDERS", "switchboard", reply, 1)) == (
        f"+ACK to {reply} (stream ORDERS, consumer switchboard)"
    )
    assert factory.describe_ack("amqp", AckIntentView("amqp", "jobs", None, "5f1c:42", 1)) == (
        "basic.ack of delivery tag 42 on channel 5f1c of queue jobs, sent by the ingester that received it,"
        " after its commit"
    )


def test_the_acker_has_no_part_in_an_adapter_its_ingester_acks() -> None:
    from ingest.config.adapter import read_adapter

    amqp = read_adapter({"name": "jobs", "transport": "amqp", "source": "jobs"}, "redis://127.0.0.1:6379/0")
    assert factory.acked_by(amqp) == "consumer"
    with pytest.raises(TypeError, match="its ingester acks"):
        factory.make_acknowledger(amqp)
    redis = read_adapter({"name": "orders", "source": "orders"}, "redis://127.0.0.1:6379/0")
    assert factory.acked_by(redis) == "acker"


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.ORDERS.switchboard.3.41.40.1796221376233174239.7",
        "$JS.ACK.hub.ACCHASH.ORDERS.switchboard.3.41.40.1796221376233174239.7.tok",
        "$JS.ACK.hub.ACCHASH.ORDERS.switchboard.3.41.40.1796221376233174239.7",  # 11 tokens: nats-py's
    ],
)
def test_a_deliverys_position_is_what_nats_py_reads_from_its_subject(reply: str) -> None:
    from nats.aio.msg import Msg

    from ingest.adapters.nats.jetstream import position

    msg = Msg(_client=None, subject="ORDERS.new", reply=reply, data=b"{}")  # type: ignore[arg-type]
    meta = msg.metadata
    assert position(msg) == (str(meta.sequence.stream), meta.num_delivered) == ("41", 3)


def test_every_registered_transport_has_its_parts() -> None:
    """Walks the registration table: each transport's folder holds its
    settings (a definition under its own name, modes, URL schemes its check
    takes) and its modes module (one implementation per mode it declares),
    ``switchboard --help`` names each of its variables, its package ships,
    its client is pinned, its status figures feed the broker gauges, and the
    contract suite runs on it. A transport
    added without one of them fails here; the docs' list of the files a new
    transport touches is this test's (docs/transports.md)."""
    from ingest.cli.help_pages import _ENVIRONMENT
    from ingest.config.transport import no_figures
    from ingest.config.transports import definitions

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]
    extras = project["project"]["optional-dependencies"]
    pinned = {
        line.split("==")[0].strip().lower()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line
    }
    (settings_contract,) = [
        c
        for c in project["tool"]["importlinter"]["contracts"]
        if c["name"].startswith("A transport's settings are the config's")
    ]
    for name, definition in definitions().items():
        folder = ROOT / "ingest" / "adapters" / name
        for part in FOLDER_PARTS:
            assert (folder / part).is_file(), f"{name}: no {part}"
        assert definition.name == name
        assert definition.modes, name
        assert definition.url_schemes, name
        assert definition.figures is not no_figures, f"{name}: its status figures feed no broker gauge"
        package = factory.transport(name)
        assert set(package.MODES) == set(definition.modes), name
        assert package.MESSAGING_SYSTEM, name
        for variable in definition.variables:
            assert f"  {variable} " in _ENVIRONMENT, f"{name}: --help lacks {variable}"
        assert f"ingest.adapters.{name}" in packages, f"{name}: its package is not shipped"
        assert f"ingest.adapters.{name}.settings" in settings_contract["source_modules"], (
            f"{name}: its settings are outside the import contract"
        )
        if definition.extra is not None:
            for requirement in extras[definition.extra]:
                client = re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0].lower()
                assert client in pinned, f"{name}: constraints.txt does not pin {client}"
        assert (ROOT / "tests" / "integration" / "adapters" / f"test_contract_{name}.py").is_file(), name
        demo = importlib.import_module(f"ingest.adapters.{name}.demo")
        assert callable(demo.opened), f"{name}: its demo source opens no server"


# What the docs list as the files a new transport touches, by the checks above
# (the extras in the image: tests/unit/test_deployment_files.py).
FOLDER_PARTS = ("__init__.py", "settings.py", "modes.py", "demo.py")
TOUCHED = {
    "ingest/adapters/<name>/__init__.py",
    "ingest/config/transports.py",
    "pyproject.toml",
    "constraints.txt",
    "ops/Dockerfile",
    "tests/integration/adapters/test_contract_<name>.py",
    "docs/transports.md",
    "docs/configuration.md",
}


def test_the_docs_list_the_files_a_new_transport_touches() -> None:
    text = (ROOT / "docs" / "transports.md").read_text()
    section = text.split("### Files a new transport touches", 1)[1].split(
        "Where the transport offers more", 1
    )[0]
    bullets = [line for line in section.splitlines() if line.startswith("* ")]
    named = [item for bullet in bullets for item in re.findall(r"`([^`]+)`", bullet)]
    listed = {item for item in named if "/" in item or re.fullmatch(r"[\w.-]+\.(toml|txt)", item)}
    assert listed == TOUCHED


def test_a_transport_added_at_run_time_is_checked_before_it_counts() -> None:
    """A package that does not load, or a name taken, is refused at once;
    what is registered goes on being read as before."""
    from ingest.config import transports

    before = dict(transports.definitions())
    with pytest.raises(ModuleNotFoundError):
        transports.add("pigeon", "tests.support.no_such_transport")
    with pytest.raises(TypeError, match="no TransportDefinition of 'pigeon'"):
        transports.add("pigeon", "tests.support.memory_transport")  # its DEFINITION is "memory"'s
    with pytest.raises(ValueError, match="registered already"):
        transports.add("redis", "tests.support.memory_transport")
    assert dict(transports.definitions()) == before
    transports.add("memory", "tests.support.memory_transport")
    try:
        with pytest.raises(ValueError, match="registered already"):
            transports.add("memory", "tests.support.memory_transport")
        assert list(transports.definitions()) == [*before, "memory"]
        assert factory.transport("memory").MODES.keys() == {"queue"}
    finally:
        transports.remove("memory")
    assert dict(transports.definitions()) == before
