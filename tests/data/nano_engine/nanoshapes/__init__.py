"""A tiny nano-vllm-style package for kvspec's engine-level tests (written for kvspec), shaped
as some public forks are: its Scheduler is built from separate numbers (no Config), takes
requests through ``add_request``, and ``schedule()`` returns (sequence, tokens) pairs that
``postprocess`` takes back; its manager declares no policies (its admission gate reads no
hash, so it cannot count hits) and binds its table to an annotated local."""
