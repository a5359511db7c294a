"""vLLM support, in one place: every release from 0.8.0, at the pool, cache and engine levels.

Read top to bottom:

    compat         what differs between releases, found by feature (signatures, helpers by
                   name, optional modules), never by version; what a release lets the cache
                   level draw (``cache_api``); every call into vLLM is built here
    patch          the installed vLLM's ``vllm.v1.core`` family imported with a diff applied,
                   in memory, without writing the installed files
    target         the ``vllm`` target: BlockPool at the pool level, KVCacheManager with one
                   full-attention group at the cache level, on real ``Request`` objects
    groups         KVCacheManager with several KV-cache groups (``--kv-groups``), chunked
                   prefill, drafts, extra keys in the release's own key layout, connector
                   tokens and a binding ``max_model_len``
    engine         the real v1 Scheduler on the CPU, behind a recorder of its manager calls
    engine_async   the same with async scheduling (its AsyncScheduler, a step in flight) and
                   the connector's asynchronous loads
    engine_compat  what the engine level needs to drive the older releases' Schedulers
    inputs         the inputs deployments send (reset, lookahead drafters, priority,
                   connector, async scheduling, streaming sessions), detected by feature
    connector      a small CPU KV connector written against the release's own connector
                   interface
    history        the policies of each release's time and the shipped bugs a finding on a
                   release is matched to (the release sweep's labels)

The release sweep that runs all of it over every release is ``tools/vllm_releases.py``.
The shared vLLM-v1-shaped pool driver (``kvspec.targets.v1_driver``) stays with the
targets: kvspec's own ``impl`` and users' v1-style pools are driven through it too.

Nothing here is imported by the core (``spec``, ``check``, ``mc``, ``report``): they know
vLLM only through the target interface, and importing this package does not import vLLM.

May import: spec, errors, patching, targets (the target interface and the v1 driver) and
engine (the engine protocol). Never check, mc, corpus, report, stateful or cli.
"""
