"""The state writer's batches change each todo once per statement: a second
change of a todo waits for the next batch, so that it meets the state the
first one left (two redeliveries of a done todo both answered "done", not
one of them guessed)."""

from __future__ import annotations

import uuid
from concurrent.futures import Future

from backhalf import todos
from backhalf.state_writer import _End, _split, _Start


def start(todo_id: int) -> _Start:
    return _Start(todos.StartRequest(todo_id, "q", uuid.uuid4(), 60.0, 5))


def end(todo_id: int) -> _End:
    run = todos.Started(todos.Todo(todo_id, "q", {}, "k", 1), "dispatched", uuid.uuid4())
    return _End(todos.Ending(run, "done", None, "done"), Future())


def test_distinct_todos_go_in_one_batch() -> None:
    batch: list[_Start | _End] = [start(1), end(2), start(3)]
    starts, ends, later = _split(batch)
    assert [s.todo_id for s in starts] == [1, 3]
    assert ends == [batch[1]]
    assert later == []


def test_a_second_change_of_a_todo_waits_for_the_next_batch() -> None:
    batch: list[_Start | _End] = [start(1), start(1), end(2), start(2), start(1)]
    starts, ends, later = _split(batch)
    assert starts == [batch[0]]
    assert ends == [batch[2]]
    assert later == [batch[1], batch[3], batch[4]]
    starts, ends, later = _split(later)
    assert starts == [batch[1], batch[3]]
    assert later == [batch[4]]
