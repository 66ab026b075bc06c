"""Where the two sides of an A/B run (gates/ab.py) come from: the base revision resolved (with --merge-base, what a
pull request changes) and checked out, detached, into a temporary git worktree, or an existing checkout given as
--base-tree; and what a checkout says of itself (its commit, uncommitted changes), for the record and for the
baseline refresh. Apart from the rounds (gates/ab_rounds.py) and the command (gates/ab.py): this part is git's,
and runs nothing of the engine's.

ABError lives here, the lowest of the A/B modules, so that the revisions, the rounds and the command raise the one
error (exit 2) without importing each other."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class ABError(Exception):
    """The A/B run could not be made (exit 2): a revision, a worker, the deadline."""


def git(*args: str, cwd: Path = REPO) -> str:
    p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise ABError(f"git {' '.join(args)} (in {cwd}) failed: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout.strip()


def resolve(rev: str, merge_base: bool, repo: Path = REPO) -> str:
    """The commit to compare against: `rev`, or its merge base with HEAD (what a pull request changes)."""
    commit = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", cwd=repo)
    return git("merge-base", "HEAD", commit, cwd=repo) if merge_base else commit


def describe_tree(tree: Path) -> dict:
    """The checkout's commit and whether it has uncommitted changes (None where it is not a git checkout)."""
    try:
        commit = git("rev-parse", "HEAD", cwd=tree)
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", cwd=tree))
    except (ABError, OSError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


@contextmanager
def worktree(commit: str, repo: Path = REPO, keep: bool = False):
    """The commit checked out (detached) into a temporary git worktree, removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="stepgate-ab-base-"))
    git("worktree", "add", "--detach", "--force", str(where), commit, cwd=repo)
    try:
        yield where
    finally:
        if not keep:
            subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=repo, capture_output=True)
            shutil.rmtree(where, ignore_errors=True)


@contextmanager
def base_checkout(a, meta: dict):
    """The base side's tree from the parsed command line: --base-tree as given, else --base (or its merge base)
    in a temporary worktree; `meta` gets the commit where this resolved one."""
    if a.base_tree:
        yield Path(a.base_tree).resolve()
        return
    commit = resolve(a.base, a.merge_base, Path(a.head_tree))
    meta.update(commit=commit, dirty=False, merge_base=bool(a.merge_base))
    with worktree(commit, Path(a.head_tree), keep=a.keep_worktree) as tree:
        yield tree
