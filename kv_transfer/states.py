"""Transfer states of one request, ordered so that merging views is `min`/`max`.

    BOOTSTRAPPING -> WAITING -> TRANSFERRING -> DONE
          \\            \\            \\
           `-----------> FAILED <------'

BOOTSTRAPPING: receiver allocated pages / sender is handshaking. WAITING: peers agreed,
no page bytes moved yet. TRANSFERRING: some layers moved. DONE: every layer of every
expected head arrived and the final notice (first token, prompt length) is in. FAILED:
terminal, from any non-terminal state (peer death, deadline, rejected message, cancel).
Transitions only move forward; DONE and FAILED never change.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum


class TransferState(IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING = 2
    TRANSFERRING = 3
    DONE = 4

    @property
    def terminal(self) -> bool:
        return self in (TransferState.FAILED, TransferState.DONE)


@dataclass(slots=True)
class TransferStatus:
    """A request's stage with the monotonic time it entered each state."""

    request_id: str
    state: TransferState = TransferState.BOOTSTRAPPING
    entered: dict[TransferState, float] = field(default_factory=dict)
    error: str | None = None
    first_token: int | None = None
    prompt_len: int | None = None
    # a ledger that releases pages on the terminal state sets this False and calls finish()
    # after the release, so that wait() returning DONE/FAILED means the pages are settled
    signal_on_terminal: bool = field(default=True, repr=False)
    _finished: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        self.entered.setdefault(self.state, time.monotonic())

    def advance(self, state: TransferState) -> bool:
        """Move forward to `state`; returns False (and changes nothing) otherwise."""
        if self.state.terminal or (state != TransferState.FAILED and state <= self.state):
            return False
        self.state = state
        self.entered[state] = time.monotonic()
        if state.terminal and self.signal_on_terminal:
            self._finished.set()
        return True

    def finish(self) -> None:
        """Wake wait()ers of a terminal status whose ledger has finished its release."""
        self._finished.set()

    def fail(self, reason: str) -> bool:
        if not self.advance(TransferState.FAILED):
            return False
        self.error = reason
        return True

    def wait(self, timeout: float | None = None) -> TransferState:
        self._finished.wait(timeout)
        return self.state

    def elapsed(self) -> float:
        """Seconds from the first recorded state to the last."""
        times = self.entered.values()
        return max(times) - min(times)
