"""Adapter failure is not a target bug (issue 12): when kvspec cannot build the target's
inputs (a Sequence) or read its state, `kvspec check` exits 2 with one line naming what it
could not do, never a NO_CRASH finding; an exception raised inside the target's own
methods still is one."""
import textwrap
from pathlib import Path

import pytest

from kvspec.check.session import Session
from kvspec.cli import main
from kvspec.errors import TargetError
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit
from kvspec.targets.registry import load_target

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "my_block_manager.py"


def _module(tmp_path: Path, extra: str, replace: tuple[str, str] = ("", "")) -> str:
    src = EXAMPLE.read_text().replace(*replace) if replace[0] else EXAMPLE.read_text()
    f = tmp_path / "bm_with_seq.py"
    f.write_text(src + textwrap.dedent(extra))
    return f"{f}:BlockManager"


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("kvspec: note:")]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_a_sequence_kvspec_cannot_build_is_exit_2(tmp_path, capsys):
    spec = _module(tmp_path, """

        class Sequence:
            def __init__(self, token_ids, sampling_config):  # nothing kvspec knows how to fill
                self.token_ids = list(token_ids)
        """)
    err = _one_line(capsys, ["check", "--target", spec, "--budget", "1"])
    assert "its constructor needs 'sampling_config'" in err


def test_a_sequence_that_fails_mid_run_is_exit_2_not_no_crash(tmp_path, capsys):
    spec = _module(tmp_path, """

        from kvspec.targets.nano_sequence import Sequence as _Base


        class Sequence(_Base):
            def __init__(self, token_ids, block_size=None):
                if len(list(token_ids)) > 3:
                    raise ValueError("this Sequence takes at most 3 tokens")
                super().__init__(token_ids, block_size)
        """)
    t = load_target(spec)
    s = Session(t, Config(level="cache", num_blocks=6, block_size=2))
    assert s.apply(Admit("r1", (1, 2, 3))) == []
    with pytest.raises(TargetError, match="kvspec could not build a .*Sequence.*at most 3 tokens"):
        s.apply(Admit("r2", (1, 2, 3, 4)))
    err = _one_line(capsys, ["check", "--target", spec, "--max-examples", "50", "--report-dir", str(tmp_path)])
    assert "kvspec could not build" in err and "NO_CRASH" not in err


def test_an_exception_inside_the_target_is_still_no_crash(tmp_path):
    spec = _module(tmp_path, "", ("    def deallocate(self, seq", "    def deallocate(self, seq, _=None):\n"
                                  "        raise RuntimeError('boom')\n\n    def _unused(self, seq"))
    t = load_target(spec)
    s = Session(t, Config(level="cache", num_blocks=6, block_size=2))
    assert s.apply(Admit("r1", (1, 2, 3))) == []
    from kvspec.spec.ops import Finish
    found = s.apply(Finish("r1"))
    assert found and found[0].invariant == "NO_CRASH" and "boom" in found[0].message
