"""Ctrl-C held over the engine's blocks of bookkeeping, so that a KeyboardInterrupt never lands half-way through one.

A block (`with held:`) holds a SIGINT that arrives during it and delivers it at its end, through the handler that was
there before (a KeyboardInterrupt by default). Outside blocks a SIGINT acts as it would without the engine: during a
forward it raises there, and the step is undone (Engine.step).

Where the handler lives: swapping it costs about 10 us a swap on a host CPU, two swaps a block, two blocks a step, so
`installed()` (Engine.run holds it over the whole run) puts the handler in once and a block only counts itself; a
block outside it (a step() or submit() called on its own) swaps the handler for itself, as before. Only the main
thread receives signals and may set a handler: in any other thread a block is a no-op.

A process that ignores SIGINT (SIG_IGN: what a shell without job control gives a command started with `&`, as CI
runners and `nohup ... &` do) keeps ignoring it: a Ctrl-C held in a block is dropped at its end, as it would have
been without the engine. (Session 12 took this handler out for a while: a test that expects a KeyboardInterrupt from
an injected SIGINT failed in a clean-clone CI run started in the background. The cause was that inherited SIG_IGN,
found in session 13; tests/test_step_atomic.py now puts Python's own handler in for its module.)
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class HeldSigint:
    def __init__(self):
        self.depth = 0              # open blocks (main thread only)
        self.caught = False         # a SIGINT arrived during them
        self.old = None             # the handler ours replaced, while ours is in
        self.per_block = False      # ours was put in by the outermost open block, not by installed()

    @staticmethod
    def can_install() -> bool:
        # getsignal None: a handler set outside Python, which could not be put back
        return threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None

    def install(self) -> bool:
        if self.old is not None or not self.can_install():
            return False
        self.old = signal.signal(signal.SIGINT, self.handler)
        return True

    def uninstall(self) -> None:
        signal.signal(signal.SIGINT, self.old)
        self.old = None

    @contextmanager
    def installed(self):
        """Our handler in for the whole `with` (blocks inside it swap nothing)."""
        mine = self.install()
        try:
            yield self
        finally:
            if mine:
                self.uninstall()

    def handler(self, signum, frame) -> None:
        if self.depth:
            self.caught = True
        else:
            self.forward(signum, frame)

    def forward(self, signum, frame) -> None:
        """What the handler we replaced would have done."""
        old = self.old
        if callable(old):
            old(signum, frame)
        elif old != signal.SIG_IGN:             # SIG_DFL: the process ends, as it would have
            self.uninstall()
            signal.raise_signal(signum)

    def __enter__(self) -> "HeldSigint":
        if threading.current_thread() is threading.main_thread():
            if self.depth == 0:
                self.per_block = self.install()
            self.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.depth -= 1
        if self.depth:
            return
        caught, self.caught = self.caught, False
        if self.per_block:
            self.per_block = False
            self.uninstall()
            if caught:      # again, through the handler put back
                signal.raise_signal(signal.SIGINT)
        elif caught and self.old is not None:
            self.forward(signal.SIGINT, None)
