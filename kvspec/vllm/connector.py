"""A small CPU KV connector written against the installed vLLM's own connector interface
(``KVConnectorBase_V1``), plugged into the real v1 Scheduler the way a deployment plugs
one in: a ``KVTransferConfig`` naming this module and class.

It plays a remote KV store that holds the KV of a drawn set of prompt prefixes
(``Config.connector``: token lists joined by '|', each a whole number of blocks). Its
meaning, which the engine's manager calls are replayed against (``Admit.external``):

- asked for a request (``get_num_new_matched_tokens``), it offers the tokens after the
  locally computed ones up to the end of the longest remote prefix the request's tokens
  start with, never the request's last token (the engine computes at least one), and
  loads them synchronously (the KV is in place when the step runs);
- those tokens' KV is the KV of exactly that request's prefix (the remote store holds
  what the prefix computes to), so reading it is as good as computing it.

With ``async;`` before the prefixes (``Config.connector = "async;1,2,3,4"``) it loads
asynchronously, as a P/D consumer does: it answers ``load_kv_async=True``, the scheduler
allocates the request's blocks and parks it (``WAITING_FOR_REMOTE_KVS``), and the load
finishes ``LOAD_STEPS`` engine steps after the step that started it: the engine reports it
in that step's model-runner output (``finished_recving``, in ``kv_connector_output`` where the
release has it: ``VllmEngine``), as a worker-side connector's ``get_finished`` would.
The meaning is the same KV, arriving later: while it arrives, the request holds the blocks
it is written into (and nothing reads them); once it has arrived, the request goes on as
if it had read them synchronously.

Only the scheduler side does anything; the worker side (no model runs here) is no-ops.
Not modelled yet: failed loads and invalid blocks.
"""
from __future__ import annotations

from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

try:   # a connector must declare hybrid-manager support where the release asks for it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - releases without the hybrid manager's check
    SupportsHMA = object   # type: ignore[misc,assignment]

CLASS_NAME = "KvspecRemoteConnector"


ASYNC = "async;"   # a Config.connector prefix: the connector loads asynchronously
# an asynchronous load reports finished in the output of the second engine step after the one
# that started it (remote KV takes a while: a request may be aborted, or others run, meanwhile)
LOAD_STEPS = 2


def loads_async(spec: Optional[str]) -> bool:
    """Whether ``spec`` (a ``Config.connector``) asks for asynchronous loads."""
    return bool(spec) and spec.startswith(ASYNC)


def parse_remote(spec: Optional[str]) -> list[tuple[int, ...]]:
    """'1,2,3,4|11,12,13,14' -> the remote prefixes, longest first ('async;' aside)."""
    if not spec:
        return []
    if loads_async(spec):
        spec = spec[len(ASYNC):]
    out = [tuple(int(t) for t in part.split(",") if t) for part in spec.split("|")]
    return sorted((p for p in out if p), key=len, reverse=True)


def remote_tokens(tokens: tuple[int, ...] | list[int], computed: int, remote: list[tuple[int, ...]]) -> int:
    """The connector's offer (see the module doc): tokens after ``computed`` it supplies."""
    n = len(tokens)
    for p in remote:
        if len(p) <= n and tuple(tokens[: len(p)]) == p:
            return max(0, min(len(p), n - 1) - computed)
    return 0


class KvspecRemoteConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """The connector of the module doc."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        import inspect
        if "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters:
            super().__init__(vllm_config, role, kv_cache_config)
        else:   # a release whose connectors take two arguments
            super().__init__(vllm_config, role)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.remote = parse_remote(extra.get("remote"))
        self.load_async = loads_async(extra.get("remote"))
        self.offered: dict[str, int] = {}     # request -> external tokens of its last admission
        # request -> its last answer to get_num_new_matched_tokens, which the scheduler passes
        # on to allocate_slots: as num_external_computed_tokens, or inside num_new_tokens before
        # 0.14.0 (kvspec.vllm.engine reads it there, to know which slots the load writes)
        self.matched: dict[str, int] = {}
        self.loading: list[str] = []          # requests whose asynchronous load started, not yet reported

    # -- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        n = remote_tokens(list(request.all_token_ids), num_computed_tokens, self.remote)
        self.matched[request.request_id] = n
        return n, self.load_async and n > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.offered[request.request_id] = num_external_tokens
        if self.load_async and num_external_tokens > 0 and request.request_id not in self.loading:
            self.loading.append(request.request_id)

    def take_started_loads(self) -> list[str]:
        """The asynchronous loads started since the last call (the engine reports them
        finished in the next step's output: kvspec's stand-in for the worker side)."""
        out, self.loading = self.loading, []
        return out

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict]]:
        self.offered.pop(request.request_id, None)   # a load in flight still finishes (and is reported)
        self.matched.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict]]:
        return self.request_finished(request, block_ids)

    # -- worker side: no model runs ------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def report_loads(output: Any, finished: list[str]) -> Any:
    """``output`` (a ``ModelRunnerOutput``) carrying ``finished`` as the asynchronous loads
    the worker side finished this step: in ``kv_connector_output`` where the release has
    one (0.10.1 on), else in the output's own ``finished_recving`` (0.9.x, 0.10.0)."""
    if not finished:
        return output
    fields = getattr(type(output), "__dataclass_fields__", {}) or {}
    if "kv_connector_output" in fields:
        from vllm.v1.outputs import KVConnectorOutput
        output.kv_connector_output = KVConnectorOutput(finished_recving=set(finished))
    else:
        output.finished_recving = set(finished)
    return output


def transfer_config(remote: str) -> Any:
    """The ``KVTransferConfig`` that plugs this connector in, serving ``remote``."""
    from vllm.config import KVTransferConfig
    return KVTransferConfig(kv_connector=CLASS_NAME, kv_connector_module_path=__name__, kv_role="kv_both",
                            kv_connector_extra_config={"remote": remote})
