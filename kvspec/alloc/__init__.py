"""The allocator level (issue 31): what any block allocator promises whatever its API,
checked through kvspec's pool and cache levels.

- ``shapes``: the shapes kvspec recognizes (a free list, a sequence-keyed allocator), from
  method names and signatures, or declared in ``[tool.kvspec.alloc]``;
- ``build``: building one for a run (constructor parameters filled by name, config objects);
- ``pool_driver``: the pool level on a free list (Alloc/Free);
- ``seq_manager``: the cache level on a sequence-keyed allocator, through the nano-vllm driver;
- ``cow``: the copy-on-write probe where a sequence allocator forks (COPY_ON_WRITE);
- ``kv_tensors``: KV_INTEGRITY on the KV tensors an allocator owns;
- ``radix``: trie / radix prefix caches without an allocator of their own, driven at the
  cache level over a free list kvspec supplies;
- ``proposal``: the declaration kvspec proposes where it cannot infer one;
- ``target``: the loader, the mapping shown, the contract bound at load.

May import: spec, errors, patching and targets (the target interface, the nano-vllm driver
the sequence allocators run through). Never check, mc, corpus, report, stateful or cli.
"""
