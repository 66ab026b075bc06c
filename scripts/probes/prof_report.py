"""Print a cProfile dump's top functions by own time and by cumulative time (for a profile taken on the device).

    python -m scripts.probes.prof_report FILE.prof [N]
"""
import pstats
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    n = int(argv[1]) if len(argv) > 1 else 40
    st = pstats.Stats(argv[0])
    st.sort_stats("tottime").print_stats(n)
    st.sort_stats("cumulative").print_stats(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
