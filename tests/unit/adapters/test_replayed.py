"""The replay buffer every mode that keeps its unstored deliveries itself
shares (``ingest.adapters.base.Replayed``): a rewind gives back every
unstored batch, oldest first and before what already waited; a read takes
at most its count; a stored batch is never given back."""

from __future__ import annotations

from ingest.adapters.base import Delivery, Replayed


def _batch(*ids: str) -> list[Delivery]:
    return [Delivery(f"k:{i}", i) for i in ids]


def _ids(batch: list[Delivery]) -> list[str | None]:
    return [d.message_id for d in batch]


def test_a_rewind_gives_back_the_unstored_batches_oldest_first_and_a_read_takes_its_count() -> None:
    batches = Replayed()
    batches.returned(_batch("1", "2"))
    batches.returned(_batch("3"))
    batches.returned(_batch("4", "5"))
    batches.stored()  # 1 and 2 committed: never again
    batches.rewind()
    assert _ids(batches.held()) == ["3", "4", "5"]
    assert _ids(batches.take(2)) == ["3", "4"]
    assert _ids(batches.take(2)) == ["5"]
    assert batches.take(2) == []


def test_a_second_rewind_puts_what_was_read_again_before_what_still_waits() -> None:
    batches = Replayed()
    batches.returned(_batch("1", "2", "3"))
    batches.rewind()
    assert _ids(batches.take(1)) == ["1"]  # read again, not yet stored
    batches.rewind()
    assert _ids(batches.take(10)) == ["1", "2", "3"]
    batches.stored()
    batches.rewind()
    assert batches.take(10) == []


def test_an_empty_read_is_no_batch_and_clear_forgets_everything() -> None:
    batches = Replayed()
    batches.returned([])
    batches.stored()  # nothing held: nothing to confirm
    batches.returned(_batch("1"))
    batches.rewind()
    batches.returned(_batch("2"))
    assert _ids(batches.held()) == ["2", "1"]
    batches.clear()
    assert batches.held() == []
    batches.rewind()
    assert batches.take(10) == []
