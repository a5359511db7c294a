"""Which engine machine a target gets: ``EngineMachine`` (``kvspec.engine.machine``), with
speculative decoding ``SpecEngineMachine``, and for a vLLM release with the inputs
deployments send ``InputsEngineMachine`` (``kvspec.engine.inputs_machine``; on a release
the legacy engine drives, ``LegacyInputsEngineMachine``). Its own module so that neither
machine module imports the other's subclasses."""
from __future__ import annotations

from typing import Optional

from kvspec.engine.inputs_machine import InputsEngineMachine, LegacyInputsEngineMachine
from kvspec.engine.machine import EngineMachine, SpecEngineMachine
from kvspec.stateful.base import RobustnessSink, machine_class_name
from kvspec.targets.base import Target


def engine_machine(target: Target, misuse: bool = False, on_robustness: Optional[RobustnessSink] = None,
                   kv_groups: Optional[str] = None) -> type:
    """A fresh EngineMachine subclass bound to ``target`` (its own example counters)."""
    from kvspec.engine.drivers import draws_deployment_inputs, legacy_engine_drives, supports_spec_decode
    attrs = dict(target=target, misuse=False, on_robustness=staticmethod(on_robustness) if on_robustness else None,
                 counters={"examples": 0, "steps": 0}, kv_groups=kv_groups)
    base = SpecEngineMachine if supports_spec_decode(target) else EngineMachine
    if base is SpecEngineMachine and draws_deployment_inputs(target):
        # the deployment inputs too; on a legacy-engine release, from the second batch on
        base = LegacyInputsEngineMachine if legacy_engine_drives(target) else InputsEngineMachine
    return type(machine_class_name("EngineMachine", target), (base,), attrs)
