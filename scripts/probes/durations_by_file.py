"""Where a pytest run's time went, by file and phase, from its `--durations=0` section (a gate log from the device).

    python -m scripts.probes.durations_by_file LOG [LOG...]

Setup is mostly the engines a gate builds (fixtures: compile, warm-up, captured steps), call the gate itself."""
import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+([^:\s]+)::")


def by_file(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out[m.group(3)][m.group(2)] += float(m.group(1))
    return out


def table(files: dict[str, dict[str, float]]) -> str:
    rows = sorted(files.items(), key=lambda kv: -sum(kv[1].values()))
    lines = [f"{'file':44} {'setup':>8} {'call':>8} {'teardown':>8} {'total':>8}"]
    tot = defaultdict(float)
    for name, ph in rows:
        for k, v in ph.items():
            tot[k] += v
        lines.append(f"{name:44} {ph['setup']:8.1f} {ph['call']:8.1f} {ph['teardown']:8.1f} {sum(ph.values()):8.1f}")
    lines.append(f"{'(all)':44} {tot['setup']:8.1f} {tot['call']:8.1f} {tot['teardown']:8.1f} {sum(tot.values()):8.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for path in argv:
        with open(path) as f:
            print(f"-- {path}\n{table(by_file(f.read()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
