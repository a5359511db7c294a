"""The engine level (issue 21): an engine's own scheduler drives its KV manager.

At the pool and cache levels kvspec plays the scheduler by hand. At the engine level the
machine only says what the outside world does (a request arrives, the engine takes a
step with some sampled and draft tokens, a client aborts); the engine's real scheduler
decides what to schedule, chunk, preempt and finish, and kvspec checks the KV manager's
observation and the scheduler's decisions (``StepFacts``) after every engine step.

    protocol      StepFacts, ManagerCall and the EngineDriver protocol every engine adapter follows
                  (vLLM's engine driver lives with the rest of vLLM support, in ``kvspec.vllm``)
    nano_engine   a nano-vllm package's own Scheduler
    nano_load     loading a nano-vllm package's scheduler, and its stand-in config
    drivers       which engine drives a target
    translate     an engine's manager calls as cache-level ops (one reference model for both levels)
    checks        the engine's decisions against what its manager holds (SLOTS, NO_LEAK, PRIORITY,
                  COMMON_PREFIX)
    session       EngineSession: what ``kvspec.check.session.Session`` is at the engine level
    machine       the Hypothesis machine of engine events
    inputs_machine  the same with the inputs deployments send (connector, async scheduling,
                  priority, resets, streaming sessions, system prompts), for a vLLM release
    machines      which of those machines a target gets (``engine_machine``)

May import: kvspec.spec, kvspec.targets, kvspec.errors, kvspec.patching, and, for the
machines, kvspec.stateful.base. Not kvspec.check, mc, report, corpus or cli: the cache
level's Session, which EngineSession reuses whole to check the replayed calls, is handed
in by ``kvspec.check.session.Session`` itself, so the two never import each other.
"""
