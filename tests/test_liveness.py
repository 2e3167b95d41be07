from __future__ import annotations

from protocol import Heartbeat, Hello
from protocol.liveness import Liveness, PauseWatch, WorkerState
from tests.stand_in_worker import stand_in_hello


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _hello(instance_id: str = "a") -> Hello:
    return stand_in_hello(instance_id=instance_id, is_random_weights=True, capacity=8)


def test_no_hello_means_connecting() -> None:
    assert Liveness(3, 10, Clock()).verdict().state is WorkerState.CONNECTING


def test_silence_past_the_heartbeat_timeout_means_dead() -> None:
    clock = Clock()
    liveness = Liveness(3, 10, clock)
    liveness.on_hello(_hello())
    clock.now += 2.9
    assert liveness.verdict().is_live
    clock.now += 0.2
    verdict = liveness.verdict()
    assert verdict.state is WorkerState.DEAD
    assert "HEARTBEAT_TIMEOUT_S=3" in verdict.reason


def test_frames_waiting_unread_are_no_silence() -> None:
    """A judge too busy to read its socket has not heard silence; once the frames
    are read and none follow, the timeout counts from when they last waited."""
    clock = Clock()
    liveness = Liveness(3, 10, clock)
    liveness.on_hello(_hello())
    clock.now += 5
    liveness.on_frames_waiting()
    assert liveness.verdict().is_live
    clock.now += 3.1
    assert liveness.verdict().state is WorkerState.DEAD


def test_heartbeats_without_progress_on_pending_work_mean_hung() -> None:
    clock = Clock()
    liveness = Liveness(3, 10, clock)
    liveness.on_hello(_hello())
    for _ in range(12):
        clock.now += 1
        liveness.on_heartbeat(Heartbeat("a", num_steps=7, num_queued=1, num_active=2))
    verdict = liveness.verdict()
    assert verdict.state is WorkerState.HUNG
    assert "STEP_TIMEOUT_S=10" in verdict.reason
    liveness.on_heartbeat(Heartbeat("a", num_steps=8, num_queued=1, num_active=2))
    assert liveness.verdict().is_live


def test_an_idle_worker_is_never_hung() -> None:
    clock = Clock()
    liveness = Liveness(3, 10, clock)
    liveness.on_hello(_hello())
    for _ in range(30):
        clock.now += 1
        liveness.on_heartbeat(Heartbeat("a", num_steps=7, num_queued=0, num_active=0))
    assert liveness.verdict().is_live


def test_a_new_instance_is_reported_and_heartbeats_of_others_are_ignored() -> None:
    clock = Clock()
    liveness = Liveness(3, 10, clock)
    assert liveness.on_hello(_hello("a"))
    assert not liveness.on_hello(_hello("a"))
    clock.now += 5
    liveness.on_heartbeat(Heartbeat("someone-else", 1, 0, 0))
    assert liveness.verdict().state is WorkerState.DEAD
    assert liveness.on_hello(_hello("b"))
    assert liveness.verdict().is_live


def test_greetings_again_without_heartbeats_are_not_a_hang() -> None:
    """A worker greets again a peer it forgot, having aborted what that peer had
    sent it: no work of this side waits there for a step."""
    clock = Clock()
    liveness = Liveness(3, 10, clock)
    liveness.on_hello(_hello())
    liveness.on_heartbeat(Heartbeat("a", num_steps=7, num_queued=1, num_active=2))
    for _ in range(30):
        clock.now += 1
        assert not liveness.on_hello(_hello())
        assert liveness.verdict().is_live


def test_a_turn_long_late_is_this_sides_own_pause_and_a_look_between_turns_sees_it() -> None:
    """A frontend stopped for 40 s read the heartbeats waiting from before its
    pause and declared its worker hung; a heartbeat read between ticks must see
    the pause before the next tick does."""
    clock = Clock()
    pause = PauseWatch("frontend", heartbeat_timeout_s=3, turn_s=0.5, clock=clock)
    for _ in range(10):
        clock.now += 0.5
        assert not pause.was_paused()
    clock.now += 2.9  # slow, but within the heartbeat timeout: not excused
    assert not pause.was_paused()
    clock.now += 40
    assert pause.was_paused(is_turn=False)  # a heartbeat read first
    assert not pause.was_paused()  # the tick that follows: already noticed
    clock.now += 0.4
    assert not pause.was_paused(is_turn=False)
    clock.now += 2.7  # 3.1 s since the last turn: looks between turns do not count
    assert pause.was_paused(is_turn=False)


def test_the_pause_threshold_is_three_turns_where_turns_are_slower_than_the_timeout() -> None:
    clock = Clock()
    pause = PauseWatch("frontend", heartbeat_timeout_s=1, turn_s=2, clock=clock)
    clock.now += 5.9
    assert not pause.was_paused()
    clock.now += 6.1
    assert pause.was_paused()
