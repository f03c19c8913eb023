"""``switchboard trace``, ``inbox show`` and ``inbox replay`` by filter, run
in-process (the CLI's own parser, the commands' ``run``) against rows the
tests write with SQL; the whole-way trail through real processes is
tests/system/test_trace_cli.py. Assertions are on what PostgreSQL holds
afterwards and on the lines printed."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import timedelta
from typing import Any

import pytest

from ingest.cli import inbox as inbox_command
from ingest.cli import main as cli
from ingest.cli import trace as trace_command
from ingest.config import Settings, from_mapping
from ingest.exit_codes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK
from tests.support import db

RECENT, OLD = timedelta(minutes=10), timedelta(hours=2)


@pytest.fixture
def settings(db_url: str) -> Settings:
    for name in ("orders", "billing"):
        db.query(
            db_url,
            "INSERT INTO adapters (name, transport, mode, settings)"
            " VALUES (%(n)s, 'redis', 'stream', %(s)s::jsonb)",
            {"n": name, "s": json.dumps({"source": name, "key_prefix": "redis"})},
        )
    adapters = [{"name": n, "mode": "stream", "source": n} for n in ("orders", "billing")]
    return from_mapping({"database": {"url": db_url}, "adapters": adapters}, {})


async def command(settings: Settings, *argv: str) -> int:
    args = cli._parser().parse_args(list(argv))
    runner = trace_command.run if args.verb == "trace" else inbox_command.run
    return await runner(settings, args)


def reject(db_url: str, adapter: str, n: int, error: str, body: bytes, age: timedelta, **kw: Any) -> int:
    return int(
        db.scalar(
            db_url,
            "INSERT INTO inbox (adapter, idempotency_key, source_message_id, body, body_size, body_sha256,"
            " ack_kind, ack_state, status, error, stored_at) VALUES (%(a)s, %(k)s, %(m)s, %(b)s, %(size)s,"
            " %(digest)s, 'xack', 'acked', 'rejected', %(e)s, now() - %(age)s) RETURNING id",
            {
                "a": adapter,
                "k": f"redis:{adapter}:{n}-0",
                "m": f"{n}-0",
                "b": body,
                "e": error,
                "age": age,
                "size": kw.get("size"),
                "digest": kw.get("digest"),
            },
        )
    )


def snapshot(db_url: str) -> list[Any]:
    return [
        db.query(db_url, "SELECT id, status, error, todo_id, event_id FROM inbox ORDER BY id"),
        db.query(db_url, "SELECT id, status FROM todos ORDER BY id"),
        db.query(db_url, "SELECT id FROM events ORDER BY id"),
    ]


async def test_trace_finds_each_adapters_entry_and_says_when_nothing_matches(
    settings: Settings, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first = reject(db_url, "orders", 7, "invalid_json", b"x", RECENT)
    second = reject(db_url, "billing", 7, "invalid_json", b"y", RECENT)
    assert await command(settings, "trace", "7-0", "--json") == EXIT_OK
    found = json.loads(capsys.readouterr().out)
    assert [t["inbox"]["inbox_id"] for t in found] == [first, second]  # one per stream adapter
    assert [t["inbox"]["adapter"] for t in found] == ["orders", "billing"]
    assert await command(settings, "trace", "redis:billing:7-0", "--json") == EXIT_OK
    assert [t["inbox"]["inbox_id"] for t in json.loads(capsys.readouterr().out)] == [second]
    assert await command(settings, "trace", "--inbox-id", str(first)) == EXIT_OK
    assert capsys.readouterr().out.startswith(
        f"inbox row {first}: adapter orders (redis stream, source orders)"
    )

    for argv, message in (
        (("8-0",), "switchboard trace: no stream adapter's inbox holds entry id '8-0'"),
        (("redis:jobs:abc",), "switchboard trace: no inbox row has the idempotency key 'redis:jobs:abc'"),
        (("--inbox-id", "999999"), "switchboard trace: inbox row 999999 does not exist"),
    ):
        assert await command(settings, "trace", *argv) == EXIT_FAILURE
        out = capsys.readouterr()
        assert (out.out, out.err) == ("", message + "\n")
    assert await command(settings, "trace", "7-0", "--inbox-id", "1") == EXIT_CONFIG
    assert "give exactly one of KEY_OR_ENTRY_ID and --inbox-id" in capsys.readouterr().err


async def test_inbox_show_a_prefix_and_an_unknown_row(
    settings: Settings, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = ('{"name": "é' + "x" * 5000 + '"}').encode()
    body = whole[:11]  # cut between the two bytes of "é"
    digest = hashlib.sha256(whole).digest()
    error = f"too_large: {len(whole)} bytes"
    row = reject(db_url, "orders", 1, error, body, RECENT, size=len(whole), digest=digest)
    assert await command(settings, "inbox", "show", str(row)) == EXIT_OK
    text = capsys.readouterr().out
    assert (
        f"body: only its first 11 bytes are stored, of a message of {len(whole)} bytes (sha256 of the"
        f" whole message {digest.hex()}); UTF-8 text, cut where the stored prefix ends\n"
        '  {"name": "\n'
    ) in text
    assert await command(settings, "inbox", "show", str(row), "--json") == EXIT_OK
    document = json.loads(capsys.readouterr().out)
    assert (document["body_size"], document["body_sha256"], document["error"]) == (
        len(whole),
        digest.hex(),
        error,
    )
    assert document["body"]["whole"] is False
    assert base64.b64decode(document["body"]["base64"]) == body
    assert await command(settings, "inbox", "show", "999999") == EXIT_FAILURE
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", "switchboard inbox show: inbox row 999999 does not exist\n")


async def test_replay_by_filter_dry_run_then_exactly_the_matching_rows(
    settings: Settings, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = {
        "old": reject(db_url, "orders", 1, "schema_mismatch: at /n", b'{"n": 1}', OLD),
        "percent": reject(db_url, "orders", 2, "Schema_Mismatch: 50%_off", b'{"n": 2}', RECENT),
        "poison": reject(db_url, "orders", 3, "invalid_json: line 1", b"not json", RECENT),
        "billing": reject(db_url, "billing", 4, "schema_mismatch: at /n", b'{"n": 4}', RECENT),
        "plain": reject(db_url, "orders", 5, "schema_mismatch: 50 off", b'{"n": 5}', RECENT),
    }
    before = snapshot(db_url)

    assert (
        await command(settings, "inbox", "replay", "--adapter", "orders", "--since", "1h", "--dry-run") == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines[:-1]] == [
        f"inbox row {ids[k]}" for k in ("percent", "poison", "plain")
    ]
    assert lines[0].endswith(": would be stored")
    assert f": would fail: inbox row {ids['poison']} is still rejected: invalid_json" in lines[1]
    assert lines[-1] == "dry run: 3 rows match, 2 would be stored, 1 would fail; nothing was changed"
    # % and _ are matched literally, in any case: "50 off" is not "50%_".
    assert await command(settings, "inbox", "replay", "--error-contains", "50%_", "--dry-run") == 0
    assert [line.split(" (")[0] for line in capsys.readouterr().out.splitlines()[:-1]] == [
        f"inbox row {ids['percent']}"
    ]
    assert await command(settings, "inbox", "replay", "--all-rejected", "--limit", "2", "--dry-run") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("more than 2 rows match: the 2 oldest are taken (--limit)")
    assert [line.split(" (")[0] for line in lines[1:3]] == [f"inbox row {ids[k]}" for k in ("old", "percent")]
    assert snapshot(db_url) == before  # the dry runs changed nothing

    argv = ("--adapter", "orders", "--since", "1h", "--until", "1m", "--error-contains", "SCHEMA_mismatch")
    assert await command(settings, "inbox", "replay", *argv) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    stored = dict(
        db.query(
            db_url,
            "SELECT i.id, t.payload FROM inbox i JOIN todos t ON t.id = i.todo_id WHERE i.status = 'stored'",
        )
    )
    assert stored == {ids["percent"]: {"n": 2}, ids["plain"]: {"n": 5}}
    todo_of = dict(db.query(db_url, "SELECT id, todo_id FROM inbox WHERE status = 'stored'"))
    assert lines == [
        f"inbox row {ids['percent']}: stored, todo {todo_of[ids['percent']]}",
        f"inbox row {ids['plain']}: stored, todo {todo_of[ids['plain']]}",
        "replayed 2 of 2 rows",
    ]
    rejected = {i for (i,) in db.query(db_url, "SELECT id FROM inbox WHERE status = 'rejected'")}
    assert rejected == {ids["old"], ids["poison"], ids["billing"]}
    assert db.scalar(db_url, "SELECT count(*) FROM events") == 2

    # A failing row is reported and counted; the others are replayed.
    assert await command(settings, "inbox", "replay", "--adapter", "orders") == EXIT_FAILURE
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == "replayed 1 of 2 rows (1 failed)"
    assert err.startswith(f"switchboard inbox: inbox row {ids['poison']} is still rejected: invalid_json")
    assert err.count("\n") == 1
    assert db.scalar(db_url, "SELECT status FROM inbox WHERE id = %(i)s", {"i": ids["old"]}) == "stored"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "switchboard inbox replay: no ids and no filter: give inbox row ids, or --adapter,"),
        (("--dry-run",), "switchboard inbox replay: no ids and no filter:"),
        (("--limit", "5"), "switchboard inbox replay: no ids and no filter:"),
        (("1", "--adapter", "orders"), "switchboard inbox replay: give inbox row ids, or a filter, not both"),
        (("1", "--dry-run"), "switchboard inbox replay: give inbox row ids, or a filter, not both"),
    ],
)
async def test_replay_without_a_filter_or_with_ids_and_a_filter_is_refused(
    settings: Settings, db_url: str, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    reject(db_url, "orders", 1, "schema_mismatch", b'{"n": 1}', RECENT)
    before = snapshot(db_url)
    assert await command(settings, "inbox", "replay", *argv) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(message)
    assert err.endswith("(see `switchboard inbox replay --help`)\n")
    assert err.count("\n") == 1
    assert snapshot(db_url) == before


async def test_replay_by_filter_pages_past_rows_that_keep_failing(
    settings: Settings, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The two oldest stay poison whatever is fixed; a run again with the
    # same filter alone would take them again, and never reach the rest.
    poison = [reject(db_url, "orders", n, "invalid_json", b"not json", OLD) for n in (1, 2)]
    good = [reject(db_url, "orders", n, "schema_mismatch", b'{"n": 1}', OLD) for n in (3, 4)]
    assert await command(settings, "inbox", "replay", "--all-rejected", "--limit", "2") == EXIT_FAILURE
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"more than 2 rows match: the 2 oldest are taken (--limit), up to inbox row {poison[1]};"
        f" for the rest, run again with the same filters and --after-id {poison[1]}"
    )
    assert out[-1] == "replayed 0 of 2 rows (2 failed)"

    argv = ("--all-rejected", "--limit", "2", "--after-id", str(poison[1]))
    assert await command(settings, "inbox", "replay", *argv) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "replayed 2 of 2 rows"
    assert not any(line.startswith("more than") for line in out)
    status = dict(db.query(db_url, "SELECT id, status FROM inbox"))
    assert status == {poison[0]: "rejected", poison[1]: "rejected", good[0]: "stored", good[1]: "stored"}


@pytest.mark.parametrize(
    "argv",
    [("1", "--after-id", "3"), ("--after-id", "3")],
)
async def test_after_id_goes_with_a_filter_only(
    settings: Settings, db_url: str, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    reject(db_url, "orders", 1, "schema_mismatch", b'{"n": 1}', RECENT)
    before = snapshot(db_url)
    assert await command(settings, "inbox", "replay", *argv) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("switchboard inbox replay: ")
    assert ("not both" in err) == ("1" in argv)
    assert snapshot(db_url) == before


async def test_terminal_controls_in_stored_errors_are_printed_escaped(
    settings: Settings, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A rejected message's error quotes its body: "\x1b]0;pwned\x07" would
    # retitle the operator's terminal, "\x1b[2J" clear it.
    error = "invalid_json: near '\x1b]0;pwned\x07\x1b[2J\u202e'"
    row = reject(db_url, "orders", 1, error, b"not json", RECENT)
    escaped = "invalid_json: near '\\u001b]0;pwned\\u0007\\u001b[2J\\u202e'"
    for argv in (
        ("trace", "--inbox-id", str(row)),
        ("inbox", "list", "--rejected"),
        ("inbox", "show", str(row)),
        ("inbox", "replay", "--all-rejected", "--dry-run"),
    ):
        assert await command(settings, *argv) == EXIT_OK
        out = capsys.readouterr().out
        assert escaped in out, argv
        assert {"\x1b", "\x07", "\u202e"}.isdisjoint(out), argv
    # --json keeps the text as stored (JSON escapes the controls itself).
    assert await command(settings, "trace", "--inbox-id", str(row), "--json") == EXIT_OK
    assert json.loads(capsys.readouterr().out)[0]["inbox"]["error"] == error
