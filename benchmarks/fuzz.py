"""Hostile and broken inputs, by the thousand: every reader of tests/test_fuzz.py (IDX, CIFAR
pickles, .npz, safetensors, image folders, `vitlab predict`, YAML configs) on freshly generated
inputs (random, not the suite's fixed seed). Prints the inputs tried per reader and whether any
raised an exception other than vitlab's own errors.

    .venv/bin/python benchmarks/fuzz.py [--examples 3000] [READER ...]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_fuzz import CASES, fuzz  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=3000)
    parser.add_argument("readers", nargs="*", metavar="READER",
                        help=f"any of {', '.join(CASES)} (default: all)")  # fmt: skip
    args = parser.parse_args()
    unknown = [r for r in args.readers if r not in CASES]  # Python 3.11's choices= refuses []
    if unknown:  # a misspelt reader was printed as an escaped KeyError, exit code 0
        parser.error(f"unknown reader {', '.join(unknown)}: expected any of {', '.join(CASES)}")
    args.readers = args.readers or list(CASES)
    warnings.simplefilter("ignore")  # skipped images warn by design
    print("| reader | inputs tried | escaped (not vitlab's errors) | seconds |\n|---|---|---|---|")
    for name in args.readers:
        t0 = time.time()
        try:
            tried, escaped = fuzz(name, args.examples, derandomize=False), "none"
        except Exception as e:  # hypothesis re-raises what escaped, after shrinking it
            errors = getattr(e, "exceptions", [e])
            tried = "-"
            escaped = "; ".join(sorted({f"{type(x).__name__}: {str(x)[:80]}" for x in errors}))
        print(f"| {name} | {tried} | {escaped} | {time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
