"""Old import paths of the flat 0.1 layout, kept working for one release.

``import kvspec.ops`` (for example, in a repro file written by kvspec 0.1) gives the
very module ``kvspec.spec.ops`` and a DeprecationWarning naming the new path. The
alias is the same module object, so a monkeypatch through either name affects both.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> new module; remove in 0.3
MOVED: dict[str, str] = {
    "kvspec.ops": "kvspec.spec.ops",
    "kvspec.observation": "kvspec.spec.observation",
    "kvspec.config": "kvspec.spec.config",
    "kvspec.violation": "kvspec.spec.violation",
    "kvspec.shadow": "kvspec.spec.shadow",
    "kvspec.invariants": "kvspec.spec.invariants",
    "kvspec.model": "kvspec.spec.model",
    "kvspec.model.pool": "kvspec.spec.model.pool",
    "kvspec.model.cache": "kvspec.spec.model.cache",
    "kvspec.session": "kvspec.check.session",
    "kvspec.checker": "kvspec.check.search",
    "kvspec.minimize": "kvspec.check.minimize",
    "kvspec.repro": "kvspec.check.repro",
    "kvspec.replay": "kvspec.check.replay",
    "kvspec.crosshair_diff": "kvspec.check.crosshair",
    "kvspec.enumerate_ops": "kvspec.mc.enumerate_ops",
    "kvspec.canonical": "kvspec.mc.canonical",
    "kvspec.mc_cli": "kvspec.mc.command",
    "kvspec.corpus_runner": "kvspec.corpus.runner",
    "kvspec.report_text": "kvspec.report.text",
    "kvspec.report_files": "kvspec.report.files",
    "kvspec.figures": "kvspec.report.figures",
    "kvspec.bench": "kvspec.targets.bench",
    "kvspec.kernel_sweep": "kvspec.kernels.sweep",
    # vLLM support became one package (issue 37 part 8)
    "kvspec.targets.vllm_compat": "kvspec.vllm.compat",
    "kvspec.targets.vllm_groups": "kvspec.vllm.groups",
    "kvspec.targets.vllm_patch": "kvspec.vllm.patch",
    "kvspec.targets.vllm_target": "kvspec.vllm.target",
    "kvspec.engine.vllm_engine": "kvspec.vllm.engine",
    "kvspec.engine.vllm_compat_engine": "kvspec.vllm.engine_compat",
    "kvspec.engine.vllm_connector": "kvspec.vllm.connector",
    "kvspec.engine.vllm_inputs": "kvspec.vllm.inputs",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__  # the import system overwrites it with the alias's
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; the old path goes in kvspec 0.3", DeprecationWarning, stacklevel=3)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install() -> None:
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
