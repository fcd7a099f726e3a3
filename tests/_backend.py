# SPDX-License-Identifier: Apache-2.0
"""Markers and helpers for tests that check what JAX traces and compiles for its default backend."""

import jax
import pytest

#: Checks of the programs for the CPU, compiled for JAX's default backend
#: (run where that is the CPU: CI; skipped on a GPU machine).
cpu_default = pytest.mark.skipif(jax.default_backend() != "cpu",
                                 reason="checks the CPU's programs: JAX's default backend is not the CPU")


def traced_programs(fn):
    """``(fn(), number of programs JAX traced while it ran)``: every jit,
    eager op and compilation starts with a trace; the persistent compilation
    cache does not hide one."""
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        return fn(), len(events)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
