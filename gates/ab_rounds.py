"""The interleaved rounds of an A/B run (gates/ab.py): each side a worker process (gates/ab_worker.py, run with
its revision's tree first on the path) spoken to in JSON lines, and the driver that starts the process pairs and
times them in rounds (base, head, base, head, ...: a drift of the host lands on both), within the run's deadline.
Apart from the command (gates/ab.py), which decides on what these return, and from the revisions
(gates/ab_tree.py), which give each side its tree: tests/test_ab.py drives these rounds with sides of its own."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .ab_tree import ABError

WORKER = Path(__file__).resolve().parent / "ab_worker.py"
CLOCKS = ("wall", "cpu")      # gates/ab_worker.py times every step on both


# -- one side: a worker process ------------------------------------------------------------------------------------
@dataclass
class Side:
    name: str                  # unique in a run: "base-1", "head-1", "base-2", ...
    tree: Path
    args: list[str]            # the worker's options (benchmarks, device, ...)
    log: Path
    env_extra: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    info: dict | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(self.tree), PYTHONUNBUFFERED="1", **self.env_extra)
        if "STEPGATE_PLANT_SLOWDOWN_MS" not in self.env_extra:
            env.pop("STEPGATE_PLANT_SLOWDOWN_MS", None)     # a plant reaches only the side it is meant for
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "--tree", str(self.tree), *self.args],
                                     cwd=self.tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, bufsize=1)

    def receive(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, timeout))
        line = self.proc.stdout.readline() if ready else None
        if not line:
            why = "no answer in time" if ready == [] else f"it exited (status {self.proc.poll()})"
            raise ABError(f"{self.name} worker ({self.tree}): {why}; its log: {self.log}{self.tail()}")
        msg = json.loads(line)
        if "error" in msg:
            raise ABError(f"{self.name} worker ({self.tree}) failed: {msg['error']}; its log: {self.log}{self.tail()}")
        return msg

    def ready(self, timeout: float) -> dict:
        self.info = self.receive(timeout)["ready"]
        return self.info

    def run(self, reps: int, timeout: float) -> dict[str, dict[str, list[float]]]:
        self.proc.stdin.write(json.dumps({"cmd": "run", "reps": reps}) + "\n")
        self.proc.stdin.flush()
        return self.receive(timeout)["times"]

    def tail(self, lines: int = 12) -> str:
        try:
            text = self.log.read_text().splitlines()[-lines:]
        except OSError:
            return ""
        return "\n  " + "\n  ".join(text) if text else ""

    def quit(self) -> None:
        """Ask the worker to end, without waiting: several sides' teardowns (a second each) then overlap."""
        if self.proc and self.proc.poll() is None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass

    def stop(self) -> None:
        self.quit()
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()


# -- the rounds ----------------------------------------------------------------------------------------------------
def measure(sides: list[Side], specs: list[str], rounds: int, reps: int, deadline: float,
            startup_timeout: float, progress=print) -> tuple[dict[str, dict[str, list[list[float]]]], list[str]]:
    """Start every side at once (their loads overlap), then time `rounds` rounds, the sides in the same order every
    round (ABAB...: each side's steps always follow the other side's. Turning the order each round, ABBA, let one
    side run twice in a row, its caches warm for the second block: on the CPU host the first side of a round read
    up to 20% faster, a round's ratio swinging 0.8x-1.2x from one round to the next in an A/A run).
    Returns {side: {clock: {spec: [round's timings, ...]}}} and notes (a deadline that cut rounds)."""
    out = {s.name: {c: {spec: [] for spec in specs} for c in CLOCKS} for s in sides}
    notes = []
    t_ready = time.monotonic()
    try:
        for s in sides:
            s.start()
        for s in sides:
            s.ready(min(startup_timeout, deadline - time.monotonic()))
        progress(f"ab: {len(sides)} sides ready in {time.monotonic() - t_ready:.1f} s")
        per_round = None
        t_first = time.monotonic()
        for r in range(rounds):
            t0 = time.monotonic()
            left = deadline - t0
            if per_round is not None and left < per_round * 1.5:
                notes.append(f"deadline: {r} of {rounds} rounds measured")
                break
            for s in sides:
                times = s.run(reps, max(1.0, deadline - time.monotonic()))
                for c in CLOCKS:
                    for spec in specs:
                        out[s.name][c][spec].append(times[c][spec])
            per_round = time.monotonic() - t0
            if (r + 1) % max(1, rounds // 10) == 0:
                progress(f"ab: round {r + 1}/{rounds} ({time.monotonic() - t_first:.1f} s of rounds)")
    finally:
        for s in sides:
            s.quit()
        for s in sides:
            s.stop()
    return out, notes


def measure_pairs(sets: list[dict[str, Side]], specs: list[str], rounds: int, reps: int, deadline: float,
                  startup_timeout: float, successive: bool = False, progress=print
                  ) -> tuple[dict[str, dict[str, dict[str, list[list[float]]]]], list[int], dict[str, dict], list[str]]:
    """Time `rounds` rounds a role, spread over several sets of fresh processes (sets[p]: {role: Side}, e.g. base and
    head): each set times rounds / len(sets) of them. By default every set is alive at once and each round goes
    through all of them (base-1, head-1, base-2, head-2, ...): one start's wait for all, and a drift of the host
    lands on every set. successive: one set after another (one set's memory at a time; a start each).
    Returns {role: {clock: {spec: [round's timings, ...]}}} with the sets' rounds one set after another, the set
    (numbered from 1) of each round, each role's info from the first set (the worker's ready message), and notes."""
    per_set = -(-rounds // len(sets))
    numbered = list(enumerate(sets, start=1))
    batches = [[ns] for ns in numbered] if successive else [numbered]
    roles = list(sets[0])
    out = {r: {c: {spec: [] for spec in specs} for c in CLOCKS} for r in roles}
    set_of_round, notes = [], []
    for k, batch in enumerate(batches):
        # each batch still to run gets an equal share of the time left, so a slow start cannot starve the last set
        share = time.monotonic() + (deadline - time.monotonic()) / (len(batches) - k)
        alive = [side for _, st in batch for side in st.values()]
        try:
            timings, cut = measure(alive, specs, per_set, reps, share, startup_timeout, progress)
        except ABError as e:
            if len(alive) > len(roles) and "out of memory" in str(e).lower():
                # every pair's engines were alive at once (one GPU's memory for all of them): say how to fit
                raise ABError(f"{e}\n{len(alive)} worker processes were alive at once: run fewer pairs "
                              f"(--processes {len(batch) - 1}) or one pair at a time (--successive)") from e
            raise
        notes += [f"pair {', '.join(str(number) for number, _ in batch)}: {n}" for n in cut]
        for number, st in batch:
            done = len(timings[st[roles[0]].name][CLOCKS[0]][specs[0]])
            set_of_round += [number] * done
            for role, side in st.items():
                for c in CLOCKS:
                    for spec in specs:
                        out[role][c][spec] += timings[side.name][c][spec]
    return out, set_of_round, {r: sets[0][r].info for r in roles}, notes
