"""Text from outside cut at whitespace before anything reads it, and made
storable by PostgreSQL (issue 33)."""

from __future__ import annotations

import pytest

from backhalf.bounded_text import cut, storable
from backhalf.lifecycle.worker import MAX_ERROR_CHARS, stored_error
from backhalf.redaction import redact
from ingest.observe.logs import LOG_VALUE_MAX_CHARS, _redact_value


def test_short_text_is_kept_whole() -> None:
    assert cut("short text", 100) == "short text"


def test_a_cut_falls_on_whitespace_and_says_how_much_it_cut() -> None:
    text = "word " * 100  # 500 characters
    out = cut(text, 52)
    assert out.startswith("word " * 9 + "word [... ")
    assert out.endswith(" characters cut ...]")
    assert len(out) < 100


def test_a_cut_never_leaves_half_a_credential_for_redaction_to_miss() -> None:
    """The URL straddles the bound: cut at whitespace, none of it is left."""
    text = "x" * 30 + " postgresql://app:hunter2-long-secret@db/app and more"
    out = redact(cut(text, 45))
    assert "hunter2" not in out
    assert "postgresql" not in out


def test_a_token_longer_than_the_bound_is_dropped_whole() -> None:
    assert cut("a" * 1000, 100) == " [... 1000 characters cut ...]"


def test_a_tail_keeps_the_end_of_a_traceback() -> None:
    text = "Traceback\n" + "  frame line\n" * 1000 + "ValueError: the last line"
    out = cut(text, 200, tail=40)
    assert out.startswith("Traceback\n")
    assert out.endswith("ValueError: the last line")
    assert len(out) < 260


@pytest.mark.parametrize(
    ("text", "stored"),
    [
        ("bad\x00byte", "bad\\x00byte"),
        ("bad\udcffsurrogate", "bad\\udcffsurrogate"),
        ("\ud83d\ude00 unpaired halves", "\\ud83d\\ude00 unpaired halves"),
        ("plain ünïcödé and 😀", "plain ünïcödé and 😀"),
    ],
)
def test_nul_and_unpaired_surrogates_become_escapes(text: str, stored: str) -> None:
    assert storable(text) == stored
    storable(text).encode("utf-8")  # encodable: PostgreSQL takes it


class Echoing(Exception):
    """A handler's error that echoes its input."""


@pytest.mark.parametrize(
    "message",
    ["a" * 1_000_000, "bad\x00byte " * 1000, "\udcff" * 10_000, "postgresql://u:" + "p" * 500_000 + "@h/db"],
)
def test_a_stored_error_is_bounded_and_storable_whatever_it_holds(message: str) -> None:
    error = stored_error(Echoing(message))
    assert len(error) <= MAX_ERROR_CHARS
    assert error.startswith("Echoing:")
    assert "\x00" not in error
    error.encode("utf-8")


def test_an_error_that_cannot_be_printed_is_stored_all_the_same() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert stored_error(Unprintable()) == "Unprintable: (its message could not be printed)"


def test_a_log_field_is_cut_before_it_is_redacted() -> None:
    shown = _redact_value("a" * 1_000_000)
    assert isinstance(shown, str)
    assert len(shown) < LOG_VALUE_MAX_CHARS + 100


def test_a_tail_never_starts_between_a_key_and_its_value() -> None:
    """Review of issue 32: a tail cut at a space kept a bearer token without
    its "Authorization: Bearer" for redaction to see."""
    token = "t0k3n" * 8
    text = "x " * 5000 + f"Authorization: Bearer {token}"
    for tail in range(20, 80):
        shown = redact(cut(text, 300, tail=tail))
        assert token not in shown, tail
    lines = "x " * 5000 + f"\nheader\nAuthorization: Bearer {token}"
    assert redact(cut(lines, 300, tail=70)).endswith("Authorization: Bearer ***")
