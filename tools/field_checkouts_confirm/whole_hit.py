# Run: python tools/field_checkouts_confirm/<this file> (after python tools/field_checkouts.py --unpack puts the checkouts under /tmp/fc).
# Whole-prompt hit: a second identical prompt of full blocks is admitted with every token cached,
# so the engine's prepare_prefill gives it seqlen_q = len(seq) - num_cached_tokens = 0 tokens.
import sys, importlib
root, pkg = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import types
for name, path in ((pkg, f"{root}/{pkg}"), (f"{pkg}.engine", f"{root}/{pkg}/engine")):
    mod = types.ModuleType(name)   # the package without its __init__ (which imports GPU-only code)
    mod.__path__ = [path]
    sys.modules[name] = mod
bm = importlib.import_module(f"{pkg}.engine.block_manager")
sq = importlib.import_module(f"{pkg}.engine.sequence")
sq.Sequence.block_size = 4
m = bm.BlockManager(8, 4)
a, b = sq.Sequence([11, 12, 13, 14]), sq.Sequence([11, 12, 13, 14])
m.allocate(a)
if hasattr(m, "may_append"):
    pass
m.allocate(b)
print(root.split("/")[-1], "second request: len", len(b), "num_cached_tokens", b.num_cached_tokens,
      "-> tokens to compute", len(b) - b.num_cached_tokens)
