"""Which assignments answers an agent acts on: the age it can prove from its own clock, and contact.

Times are injected (CLOCK_BOOTTIME seconds on the agent, as the agent measures them): the server
only says how long it held the poll, so no clock is compared with another."""

from __future__ import annotations

from computepool.agent.assignment import refusal

FENCE = 4.0


def answer(held_s: float | None) -> dict[str, object]:
    out: dict[str, object] = {"version": 1, "term": 1, "assignments": []}
    if held_s is not None:
        out["held_s"] = held_s
    return out


def test_a_long_poll_answered_on_a_change_and_read_at_once_is_taken() -> None:
    # sent at 100, held 19.5 s by the server, here 0.3 s later: at most 0.8 s old
    assert refusal(answer(19.5), sent=100.0, now=119.8, fence_s=FENCE, rejoined=None, overdue=False) is None


def test_an_answer_that_sat_in_the_socket_past_the_fence_is_refused() -> None:
    why = refusal(answer(0.5), sent=100.0, now=190.0, fence_s=FENCE, rejoined=None, overdue=False)
    assert why is not None and "89.5 s old" in why and "fence time (4 s)" in why


def test_the_servers_clock_does_not_matter_only_its_hold_time() -> None:
    # the same answer whatever the server's wall clock says: only the duration it held the poll counts
    fresh = answer(10.0) | {"issued_at": "1999-01-01T00:00:00Z"}
    assert refusal(fresh, sent=100.0, now=111.0, fence_s=FENCE, rejoined=None, overdue=False) is None
    assert refusal(fresh, sent=100.0, now=115.0, fence_s=FENCE, rejoined=None, overdue=False) is not None


def test_an_answer_to_a_poll_sent_before_contact_came_back_is_refused() -> None:
    why = refusal(answer(0.1), sent=100.0, now=100.5, fence_s=FENCE, rejoined=100.2, overdue=False)
    assert why is not None and "lost and regained contact" in why
    assert refusal(answer(0.1), sent=100.3, now=100.5, fence_s=FENCE, rejoined=100.2, overdue=False) is None


def test_no_answer_is_acted_on_while_contact_is_overdue() -> None:
    why = refusal(answer(0.1), sent=100.0, now=100.5, fence_s=FENCE, rejoined=None, overdue=True)
    assert why is not None and "fence time" in why


def test_a_server_that_does_not_say_its_hold_time_gets_the_contact_checks_only() -> None:
    assert refusal(answer(None), sent=100.0, now=190.0, fence_s=FENCE, rejoined=None, overdue=False) is None
    assert refusal(answer(None), sent=100.0, now=190.0, fence_s=FENCE, rejoined=150.0, overdue=False)


def test_before_the_fence_is_known_age_is_not_judged() -> None:
    assert refusal(answer(0.0), sent=100.0, now=190.0, fence_s=None, rejoined=None, overdue=False) is None
