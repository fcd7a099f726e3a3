# SPDX-License-Identifier: Apache-2.0
"""Markers for tests that check what JAX compiles for its default backend."""

import jax
import pytest

#: Checks of the programs for the CPU, compiled for JAX's default backend
#: (run where that is the CPU: CI; skipped on a GPU machine).
cpu_default = pytest.mark.skipif(jax.default_backend() != "cpu",
                                 reason="checks the CPU's programs: JAX's default backend is not the CPU")
