"""The state writer's batches change each todo once per statement: a second
end of a todo waits for the next batch, so that it meets the state the first
one left (its run's token gone: answered as discarded, not guessed)."""

from __future__ import annotations

import uuid
from concurrent.futures import Future

from backhalf.lifecycle import todos
from backhalf.lifecycle.state_writer import _End, _split


def end(todo_id: int, to_status: str = "done") -> _End:
    run = todos.Claimed(todos.Todo(todo_id, "q", {}, "k", 1), uuid.uuid4())
    return _End(todos.Ending(run, to_status, None, to_status), Future())


def test_distinct_todos_go_in_one_batch() -> None:
    batch = [end(1), end(2), end(3, "pending")]
    ends, later = _split(batch)
    assert ends == batch
    assert later == []


def test_a_second_change_of_a_todo_waits_for_the_next_batch() -> None:
    batch = [end(1), end(1, "pending"), end(2), end(2), end(1, "failed")]
    ends, later = _split(batch)
    assert ends == [batch[0], batch[2]]
    assert later == [batch[1], batch[3], batch[4]]
    ends, later = _split(later)
    assert ends == [batch[1], batch[3]]
    assert later == [batch[4]]
    ends, later = _split(later)
    assert (ends, later) == ([batch[4]], [])
