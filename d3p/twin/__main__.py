"""``python -m d3p.twin INPUT.csv OUTPUT.csv --epsilon 1 ...`` (see :mod:`d3p.twin.cli`)."""

import sys

from d3p.twin.cli import main

if __name__ == "__main__":
    sys.exit(main())
