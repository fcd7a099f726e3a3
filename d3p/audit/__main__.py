# SPDX-License-Identifier: Apache-2.0
"""``python -m d3p.audit [options]``: the ``audit`` command on its own."""

import sys

from d3p.audit._cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
