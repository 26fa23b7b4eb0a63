"""The embedded stack: every part on one machine, supervised (``adaflash up / down / status``).

- ``stack.services``: what a part is (command, probe), start and stop order
- ``stack.plan``: which parts run where (ports, URLs, settings of each child)
- ``stack.parts``: the serving nodes and learners of a stack, their keys, its database
- ``stack.procs``: process groups and ports
- ``stack.supervisor``: starts, probes, restarts and stops the children
- ``stack.control``: ``down`` and the detached ``up``
- ``stack.cli``: the commands

The state file the supervisor writes is a shared contract: ``adaflash.stack_state``.
"""

from __future__ import annotations

from adaflash.stack_state import live_status, pid_alive, read_state
from stack.control import down, spawn_detached, wait_ready
from stack.plan import plan_stack
from stack.services import ALL_PARTS, StackError
from stack.supervisor import Supervisor

__all__ = ["ALL_PARTS", "StackError", "Supervisor", "down", "live_status", "pid_alive", "plan_stack",
           "read_state", "spawn_detached", "wait_ready"]
