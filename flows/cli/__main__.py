"""`python -m flows.cli ...` is `r1 ...`."""

from flows.cli.r1 import main

if __name__ == "__main__":
    raise SystemExit(main())
