"""Runtime guards: watchdog, signals, fault injection, health checks, profiling, memory.

May import ``core`` and ``experiments``. See docs/runtime.md for how the training loop
wires these components together.
"""
