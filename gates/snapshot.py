"""Goldens are read-only in a plain run, a pytest plugin: the golden folder is snapshotted when the session starts
and compared when it ends; anything added, removed or touched (content, mode, or a byte-identical rewrite) fails
the run, unless it was asked to write them (--regen-golden)."""
from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

from .options import gate_options


@dataclass(frozen=True)
class Entry:
    kind: str            # "file", "dir" or "link"
    size: int
    mode: int
    mtime_ns: int
    ctime_ns: int        # any change to the inode (chmod, utime, a new link) moves it
    inode: int
    sha256: str          # of a file's bytes; a link's target; "" for a folder


def entry(path: Path) -> Entry:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return Entry("link", st.st_size, st.st_mode, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, os.readlink(path))
    if stat.S_ISDIR(st.st_mode):     # a folder's times move with any temp file made and removed in it: not kept
        return Entry("dir", 0, st.st_mode, 0, 0, st.st_ino, "")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return Entry("file", st.st_size, st.st_mode, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, h.hexdigest())


def snapshot(root: Path, exempt: tuple[Path, ...] = ()) -> dict[str, Entry]:
    """Every path under `root` (relative, '/'-separated) and what it is; paths under `exempt` are left out."""
    root = Path(root)
    if not root.is_dir():
        return {}
    exempt = tuple(p.resolve() for p in exempt)
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames) + sorted(filenames):
            p = Path(dirpath) / name
            if any(p.resolve() == e or e in p.resolve().parents for e in exempt):
                continue
            out[p.relative_to(root).as_posix()] = entry(p)
    return out


def describe_change(a: Entry, b: Entry) -> str:
    what = []
    if a.kind != b.kind:
        return f"a {a.kind} became a {b.kind}"
    if a.sha256 != b.sha256:
        what.append(f"content ({a.size} -> {b.size} bytes, sha256 {a.sha256[:12]} -> {b.sha256[:12]})"
                    if a.kind == "file" else f"target {a.sha256} -> {b.sha256}")
    if a.mode != b.mode:
        what.append(f"mode {stat.S_IMODE(a.mode):04o} -> {stat.S_IMODE(b.mode):04o}")
    if not what and (a.inode, a.mtime_ns, a.ctime_ns) != (b.inode, b.mtime_ns, b.ctime_ns):
        how = f"replaced by a new {a.kind}" if a.inode != b.inode else "rewritten or its metadata touched"
        what.append(f"{how}, same content (inode {a.inode} -> {b.inode}, mtime_ns {a.mtime_ns} -> "
                    f"{b.mtime_ns}, ctime_ns {a.ctime_ns} -> {b.ctime_ns})")
    return "; ".join(what)


def differences(before: dict[str, Entry], after: dict[str, Entry]) -> list[str]:
    """One line per path added, removed or changed, sorted by path."""
    lines = []
    for path in sorted(before.keys() | after.keys()):
        a, b = before.get(path), after.get(path)
        if a is None:
            lines.append(f"added    {path}")
        elif b is None:
            lines.append(f"removed  {path}")
        elif a != b:
            lines.append(f"changed  {path}: {describe_change(a, b)}")
    return lines


class GoldenGuard:
    """Snapshots the golden folder at session start and fails the session if a plain run changed it."""

    def __init__(self, config):
        opts = gate_options(config)
        self.root = opts.golden_dir
        self.exempt = benchmark_storage(config)
        self.before: dict[str, Entry] = {}
        self.changes: list[str] = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self):
        self.before = snapshot(self.root, self.exempt)

    def pytest_sessionfinish(self, session):
        self.changes = differences(self.before, snapshot(self.root, self.exempt))
        if self.changes and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if not self.changes:
            return
        tr = terminalreporter
        tr.section("stepgate: the run changed the goldens", red=True)
        tr.write_line(f"{self.root}: goldens are read-only in a plain run, and this one changed "
                      f"{len(self.changes)} path(s):", red=True)
        for line in self.changes[:50]:
            tr.write_line(f"  {line}", red=True)
        if len(self.changes) > 50:
            tr.write_line(f"  ... and {len(self.changes) - 50} more", red=True)
        tr.write_line("Restore them (git checkout -- golden/), or regenerate deliberately: --regen-golden or "
                      "python -m gates.golden regen.", red=True)


def benchmark_storage(config) -> tuple[Path, ...]:
    """pytest-benchmark's storage when this run was asked to save into it (a baseline recorded under golden/)."""
    get = config.getoption
    try:
        saving = get("benchmark_autosave") or get("benchmark_save")
        storage = str(get("benchmark_storage") or "")
    except ValueError:      # pytest-benchmark not installed
        return ()
    if not saving or not storage.startswith("file://"):
        return ()
    return (Path(storage[len("file://"):]),)


def pytest_configure(config):
    # xdist workers share the controller's files: the controller alone checks them
    if not hasattr(config, "workerinput") and not gate_options(config).regen:
        config.pluginmanager.register(GoldenGuard(config), "stepgate-golden-guard")
