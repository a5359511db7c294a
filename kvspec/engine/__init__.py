"""The engine level (issue 21): an engine's own scheduler drives its KV manager.

At the pool and cache levels kvspec plays the scheduler by hand. At the engine level the
machine only says what the outside world does (a request arrives, the engine takes a
step with some sampled and draft tokens, a client aborts); the engine's real scheduler
decides what to schedule, chunk, preempt and finish, and kvspec checks the KV manager's
observation and the scheduler's decisions (``StepFacts``) after every engine step.

    protocol      StepFacts and the EngineDriver protocol every engine adapter follows
    vllm_engine   vLLM's v1 Scheduler on CPU
    nano_engine   a nano-vllm package's own Scheduler

May import: kvspec.spec, kvspec.targets, kvspec.errors, kvspec.patching.
Not kvspec.check / mc / report / cli (the checkers import the engine, not the reverse).
"""
