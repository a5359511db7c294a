"""Hypothesis RuleBasedStateMachines, generic over targets.

``machines_for("mypkg.pool:BlockPool")`` returns a unittest-style TestCase class
that runs kvspec's machines on that target; assign it to a ``Test*`` name in a
test module and pytest collects it.
"""
from .base import InvariantViolation, KVMachine, violation_error
from .cache import CacheMachine, cache_machine
from .pool import PoolMachine, pool_machine

__all__ = ["InvariantViolation", "KVMachine", "violation_error", "PoolMachine", "CacheMachine",
           "pool_machine", "cache_machine"]
