"""kvspec.mc.distributed: states partitioned by fingerprint (TLC's distributed mode) find
the one-process search's states level by level, resume from a checkpoint, and run on two
Ray nodes."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvspec.mc.distributed import distributed_check
from kvspec.mc.enumerate_ops import Bounds
from kvspec.mc.search import confirm, model_check
from kvspec.spec.config import Config
from kvspec.targets import load_target

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


def pool(usable):
    return Config(level="pool", num_blocks=usable + 1)


def cache(usable):
    return Config(level="cache", num_blocks=usable + 1, block_size=2)


@pytest.mark.parametrize("cfg, depth, bounds, parts", [
    (pool(3), 6, Bounds(), 3), (pool(3), 5, Bounds(symmetry=False), 2), (cache(3), 5, Bounds(), 2)])
def test_partitions_find_the_one_process_levels(cfg, depth, bounds, parts):
    one = model_check(load_target("impl"), cfg, depth, bounds)
    dist = distributed_check("impl", cfg, depth, bounds, partitions=parts, use_ray=False)
    assert dist.verdict == one.verdict == "pass" and dist.nodes == ["local"]
    assert (dist.states, dist.levels) == (one.states, one.levels) and dist.transitions >= one.transitions


@pytest.mark.parametrize("bug, cfg", [("no_evict", pool(3)), ("full_prompt_hit", cache(3))])
def test_partitions_find_a_shortest_counterexample(bug, cfg):
    patch = str(CORPUS / f"{bug}.diff")
    t = load_target("impl", patch=patch)
    one = model_check(t, cfg, 6)
    dist = distributed_check("impl", cfg, 6, partitions=2, patch=patch, use_ray=False)
    assert dist.verdict == one.verdict == "violation" and dist.invariant == one.invariant
    assert len(dist.counterexample) == len(one.counterexample)
    assert confirm(t, cfg, dist)


def test_a_stopped_search_resumes_from_its_checkpoint(tmp_path):
    cfg = pool(3)
    one = model_check(load_target("impl"), cfg, 6)
    first = distributed_check("impl", cfg, 6, partitions=2, use_ray=False, checkpoint=str(tmp_path), stop_after=3)
    assert first.verdict == "incomplete" and first.depth == 3
    rest = distributed_check("impl", cfg, 6, partitions=2, use_ray=False, checkpoint=str(tmp_path), resume=True)
    assert rest.verdict == "pass" and (rest.states, rest.levels) == (one.states, one.levels)


def test_two_ray_nodes():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install kvspec[test])")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():   # (a Ray another test left running would take this test's init)
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = pool(3)
        one = model_check(load_target("impl"), cfg, 5)
        dist = distributed_check("impl", cfg, 5, partitions=2)
        assert (dist.states, dist.levels) == (one.states, one.levels)
        assert len(dist.nodes) == 2   # one partition on each node
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize("args, needle", [(["--resume", "--partitions", "2"], "--resume needs --checkpoint"),
                                          (["--checkpoint", "x"], "go with --partitions")])
def test_cli_distributed_usage_errors_are_one_line_exit_2(args, needle):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "kvspec", "mc", "--blocks", "2", "--depth", "2", *args],
                       capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_a_time_cap_stops_between_levels_incomplete():
    r = distributed_check("impl", pool(3), 6, partitions=2, use_ray=False, time_cap=0.0)
    assert r.verdict == "incomplete" and r.depth == 1 and "time cap" in r.reason and r.seconds > 0
