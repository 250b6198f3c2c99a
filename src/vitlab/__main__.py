"""`python -m vitlab ...` (and `torchrun -m vitlab ...`) runs the command-line interface."""

from vitlab.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
