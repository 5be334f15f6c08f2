"""``python -m kvrouterd.benchmarks.instructions`` counts a streamed Route + Complete's
instructions as the difference of two callgrind runs of the same load: start-up and the index's
population cancel out, and a machine without valgrind is told so rather than shown a number."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from kvrouterd.benchmarks import instructions
from kvrouterd.benchmarks.stream_inprocess import PER_STREAM, STREAMS


@pytest.mark.parametrize("mode", ["daemon", "floor", "client"])
def test_the_driven_load_sends_every_stream_its_routes(mode: str) -> None:
    assert instructions.drive(mode, 2) == STREAMS * PER_STREAM * 2


def test_the_count_per_route_is_the_main_threads_difference_of_the_two_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stand-in for valgrind --separate-threads=yes: runs the child it is given and writes one
    # callgrind file per thread. The main thread's total is a fixed start-up plus 1,000
    # instructions per Route the child reports; a second thread's grows with each run, as a
    # watchdog's does with the clock, and must not reach the count
    fake = tmp_path / "valgrind"
    runs = tmp_path / "runs"
    fake.write_text(f"""#!{sys.executable}
import os, subprocess, sys
assert "--separate-threads=yes" in sys.argv
out = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--callgrind-out-file="))
child = sys.argv[sys.argv.index("--callgrind-out-file=" + out) + 1:]
routes = int(subprocess.run(child, capture_output=True, text=True, check=True).stdout.split()[-1])
with open({str(runs)!r}, "a+") as f:
    f.write("x")
    f.seek(0)
    run = len(f.read())
open(out + "-01", "w").write("events: Ir\\nsummary: %d\\n" % (5_000_000 + 1_000 * routes))
open(out + "-02", "w").write("events: Ir\\nsummary: %d\\n" % (7_777_777 * run))
print(routes)
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(instructions, "SHORT", 1)
    monkeypatch.setattr(instructions, "LONG", 2)
    assert instructions.instructions_per_route("client", str(fake)) == pytest.approx(1_000)
    assert runs.read_text() == "xx"


def test_without_valgrind_it_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", os.devnull)
    assert instructions.main(["--modes", "client"]) == 2
    assert "valgrind is not on PATH" in capsys.readouterr().err


def test_an_unknown_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        instructions.main(["--modes", "daemon,fast"])
    assert exit_.value.code == 2
    assert "unknown mode(s): fast" in capsys.readouterr().err
