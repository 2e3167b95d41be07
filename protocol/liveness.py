"""Is the worker alive? Judged only from what it sends: hellos and heartbeats.

Shared by the frontend (to decide when to replay) and the local supervisor (to
decide when to replace the worker).

- dead: its connection closed (the process is gone: its kernel closed the
  socket), or no heartbeat for HEARTBEAT_TIMEOUT_S (frozen, hung, partitioned),
  counted from when frames from it last waited to be read, so that a judge too
  busy to read them does not take its own deafness for the worker's silence;
- hung: heartbeats arrive, work is pending, but the step counter has not moved
  for STEP_TIMEOUT_S (a step that never returns);
- live: otherwise, once a hello has named the instance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from protocol import Heartbeat, Hello

log = logging.getLogger(__name__)


class WorkerState(StrEnum):
    CONNECTING = "connecting"  # no hello yet
    LIVE = "live"
    DEAD = "dead"
    HUNG = "hung"


@dataclass(frozen=True)
class Verdict:
    state: WorkerState
    reason: str

    @property
    def is_live(self) -> bool:
        return self.state is WorkerState.LIVE


class Liveness:
    def __init__(
        self,
        heartbeat_timeout_s: float,
        step_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.step_timeout_s = step_timeout_s
        self.hello: Hello | None = None
        self.last_heartbeat: Heartbeat | None = None
        self._clock = clock
        self._last_seen_at = 0.0
        self._last_progress_at = 0.0
        self._is_disconnected = False

    def on_hello(self, hello: Hello) -> bool:
        """Record a hello; return True if it comes from a new worker instance.

        The same instance greets again only after forgetting this side (and
        aborting what this side had sent it): nothing of this side's is pending
        there, so the step clock starts again too. Greeted over and over with no
        heartbeat between (its peer table is full, and a newcomer keeps taking
        this side's place), the worker was otherwise judged hung, every other
        tick, while it stood idle."""
        is_new = self.hello is None or hello.instance_id != self.hello.instance_id
        if is_new:
            self.hello = hello
            self.last_heartbeat = None
        self._last_seen_at = self._last_progress_at = self._clock()
        self._is_disconnected = False
        return is_new

    def on_own_pause(self) -> None:
        """This side heard nothing for a while because it did not listen (it was
        paused, or starved of CPU): the worker's silence and stillness meanwhile
        are not the worker's. Both clocks start again now."""
        if self.hello is not None:
            self._last_seen_at = self._last_progress_at = self._clock()

    def on_disconnected(self) -> None:
        """The connection closed: dead at once, until a hello on a new connection."""
        self._is_disconnected = True

    def on_heartbeat(self, heartbeat: Heartbeat) -> None:
        if self.hello is None or heartbeat.instance_id != self.hello.instance_id:
            return  # from an instance we have not been greeted by: wait for its hello
        now = self._clock()
        previous = self.last_heartbeat
        is_idle = heartbeat.num_queued == 0 and heartbeat.num_active == 0
        if previous is None or is_idle or heartbeat.num_steps != previous.num_steps:
            self._last_progress_at = now
        self.last_heartbeat = heartbeat
        self._last_seen_at = now

    def on_frames_waiting(self) -> None:
        """The worker's frames wait unread on this side (its event loop was busy):
        the worker is not silent, only not yet listened to. Its heartbeats among
        them will say how it is doing once read."""
        if self.hello is not None:
            self._last_seen_at = self._clock()

    def verdict(self) -> Verdict:
        if self.hello is None:
            return Verdict(WorkerState.CONNECTING, "no worker has said hello yet")
        if self._is_disconnected:
            return Verdict(
                WorkerState.DEAD, f"the connection to worker {self.hello.instance_id[:8]} closed"
            )
        now = self._clock()
        silent_s = now - self._last_seen_at
        if silent_s > self.heartbeat_timeout_s:
            return Verdict(
                WorkerState.DEAD,
                f"no heartbeat from worker {self.hello.instance_id[:8]} for {silent_s:.1f} s "
                f"(HEARTBEAT_TIMEOUT_S={self.heartbeat_timeout_s:g})",
            )
        stalled_s = now - self._last_progress_at
        if stalled_s > self.step_timeout_s:
            beat = self.last_heartbeat
            pending = " with work pending" if beat and (beat.num_queued or beat.num_active) else ""
            return Verdict(
                WorkerState.HUNG,
                f"worker {self.hello.instance_id[:8]} made no progress for {stalled_s:.1f} s"
                f"{pending} (STEP_TIMEOUT_S={self.step_timeout_s:g})",
            )
        return Verdict(WorkerState.LIVE, f"worker {self.hello.instance_id[:8]} is live")


class PauseWatch:
    """Notices that this side itself did not run. Its turns (a supervisor's
    verdicts, a frontend's ticks) come ``turn_s`` apart; one that comes more than
    HEARTBEAT_TIMEOUT_S (and three turns) late means it was paused (SIGSTOP) or
    starved of CPU: what its workers sent meanwhile went unheard, or waits unread
    from before the pause, and a verdict now would take a live worker for dead or
    hung. A shorter gap is not excused: turns that are merely slow must not keep
    a frozen worker from being judged."""

    def __init__(
        self,
        who: str,
        heartbeat_timeout_s: float,
        turn_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.who = who
        self.threshold_s = max(heartbeat_timeout_s, 3 * turn_s)
        self._clock = clock
        self._last_turn_at = clock()

    def was_paused(self, is_turn: bool = True) -> bool:
        """Whether this side did not run since its last turn; ``is_turn``: this is
        a turn (else only a look, between turns). Say so in the log; callers then
        give each worker's `Liveness.on_own_pause`."""
        now = self._clock()
        gap_s = now - self._last_turn_at
        is_paused = gap_s > self.threshold_s
        if is_paused:
            log.warning(
                "this %s did not run for %.1f s (paused, or starved of CPU); its workers "
                "have HEARTBEAT_TIMEOUT_S from now to be heard",
                self.who,
                gap_s,
            )
        if is_turn or is_paused:
            self._last_turn_at = now
        return is_paused
