"""The executor's mailbox (per-wait limit, broken links, stop) and the one dependency rule
from which every transport derives its messages."""

from __future__ import annotations

import threading

import pytest

from gpipe_lab.pipeline.distributed.links import message_plan
from gpipe_lab.pipeline.schedules import (
    Action,
    dependency,
    dependent,
    expected_messages,
    get_schedule,
    incoming,
    outgoing,
)
from gpipe_lab.pipeline.step.mailbox import Mailbox, Stopped, Undelivered, WaitTimeout


def test_each_wait_has_its_own_limit_and_what_came_is_handed_out() -> None:
    box = Mailbox()
    box.put(("F", 1, 0), ("a",))
    assert box.get(("F", 1, 0), 0.05) == ("a",)
    with pytest.raises(WaitTimeout):
        box.get(("F", 1, 1), 0.05)
    # a later wait starts its own limit: the earlier timeout does not carry over
    threading.Timer(0.05, box.put, (("F", 1, 1), ("b",))).start()
    assert box.get(("F", 1, 1), 30.0) == ("b",)


def test_a_broken_link_fails_only_the_messages_it_did_not_deliver() -> None:
    box = Mailbox()
    box.put(("B", 0, 3), ("g",))
    box.break_link(2, ConnectionError("closed"))
    assert box.get(("B", 0, 3), 1.0) == ("g",)
    with pytest.raises(Undelivered) as info:
        box.get(("B", 0, 2), 30.0)
    assert info.value.peer == 2 and isinstance(info.value.cause, ConnectionError)


def test_stop_wakes_a_waiting_thread_and_poll_errors_reach_the_waiter() -> None:
    box = Mailbox()
    errors: list[BaseException] = []
    started = threading.Event()

    def wait() -> None:
        started.set()
        try:
            box.get(("F", 1, 0), 30.0)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    assert started.wait(10)
    box.stop()
    t.join(10)
    assert not t.is_alive() and isinstance(errors[0], Stopped)

    def poll() -> None:
        raise RuntimeError("another rank aborted")

    with pytest.raises(RuntimeError, match="another rank aborted"):
        Mailbox().get(("F", 1, 0), 30.0, poll)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_messages_come_from_one_dependency_rule(name: str, v: int) -> None:
    K, M = 3, 4
    S = K * v
    ranks = get_schedule(name, K, M, v)
    for actions in ranks:
        for a in actions:
            dep, after = dependency(a, S), dependent(a, S)
            assert dep is None or dependent(dep, S) == a
            assert after is None or dependency(after, S) == a
            assert incoming(a, S) == (None if dep is None else (a.kind, a.stage, a.microbatch))
            assert outgoing(a, S) == (None if after is None else incoming(after, S))
    assert dependency(Action(0, "W", 0), S) is None and dependent(Action(0, "W", 0), S) is None
    # every message a rank expects is produced once by the rank of its dependency
    produced = {outgoing(a, S): k for k, actions in enumerate(ranks) for a in actions if outgoing(a, S)}
    expected = {key: src for actions in ranks for key, src in expected_messages(actions, K, S).items()}
    assert expected == produced
    plan = message_plan(ranks, list(range(K)), S)
    assert sorted(key for keys in plan.values() for key in keys) == sorted(
        key for key, src in expected.items() if src != key[1] % K)
