"""The config reference in docs/configuration.md is generated from the one
definition of each setting (ingest.config.reference): a setting changed in
the code and not in the docs, or the other way round, fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.config import sections
from ingest.config.reference import BEGIN, DOCS, END, main, markdown, replaced

REWRITE = "python -m ingest.config.reference --write"


def test_the_docs_reference_is_what_the_definitions_generate() -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert replaced(text, markdown()) == text, (
        f"{DOCS.relative_to(DOCS.parents[1])}: the block between {BEGIN} and {END} differs from what"
        f" the definitions in ingest/config generate; run `{REWRITE}` (and keep the definitions, not"
        " the table, as the place to edit)"
    )


def test_every_key_has_a_one_line_meaning() -> None:
    for section in sections():
        for s in section.settings:
            assert s.key.doc, f"{section.title} {s.name}: its Key has no doc"
            assert "\n" not in s.key.doc, f"{section.title} {s.name}: its doc is more than one line"


def test_every_section_and_key_of_the_file_is_in_the_reference() -> None:
    block = markdown()
    for section in sections():
        assert f"## `{section.title}`" in block
        for s in section.settings:
            assert f"| `{s.name}` |" in block
    assert "| `url` | string |" in block  # a shared adapter key: every transport, every mode
    # Each transport's own keys, in its own table: by mode where it has several.
    redis = block.split('## `[[adapters]] with transport = "redis"`')[1].split("## ")[0]
    assert "| `group` | `stream` | string | `switchboard` |" in redis
    assert "| `heartbeat_ttl_ms` | `list` | integer >= 1000 | 30000 (30 s) |" in redis
    assert "| `cluster` | all | boolean | False |" in redis
    nats = block.split('## `[[adapters]] with transport = "nats"`')[1].split("## ")[0]
    assert "| `group` | string | `switchboard` |" in nats
    sqs = block.split('## `[[adapters]] with transport = "sqs"`')[1].split("## ")[0]
    assert "| `ack_wait_ms` | integer 1000..43200000 | 60000 (1 min) |" in sqs
    assert "| `prune_batch_size` | integer 1..50000 | 2000 |" in block
    assert "| `prune_interval_ms` | integer >= 0 |" in block  # 0: off


def test_write_rewrites_only_the_block(tmp_path: Path) -> None:
    docs = tmp_path / "configuration.md"
    docs.write_text(f"# Prose before\n\n{BEGIN}\nstale\n{END}\n\nProse after.\n", encoding="utf-8")
    assert main(["--write"], docs=docs) == 0
    written = docs.read_text(encoding="utf-8")
    assert written == f"# Prose before\n\n{BEGIN}\n\n{markdown()}\n{END}\n\nProse after.\n"
    assert main(["--write"], docs=docs) == 0
    assert docs.read_text(encoding="utf-8") == written  # twice is once
    docs.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no '<!-- BEGIN generated"):
        main(["--write"], docs=docs)


def test_without_write_it_prints_the_block(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert capsys.readouterr().out == markdown()
