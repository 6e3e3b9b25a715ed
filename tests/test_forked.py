"""``helpers.Forked``, the forked process that the tests of signals, kills and resource limits run ``train.py`` in:
a process of its own, which sees what a fresh interpreter would (its environment, directory, arguments, streams,
signal dispositions), and ends with its script's exit status."""
import os
import signal
import time

import pytest

from helpers import Forked, run_ranks

SHOW = """
import os, signal, sys
print("pid", os.getpid(), "cwd", os.getcwd(), "env", os.environ.get("MARK"), "argv", sys.argv[1:])
print("sigterm default", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_child_is_a_process_of_its_own(tmp_path):
    child = Forked(["3", "x"], env={"MARK": "seen"}, cwd=tmp_path, code=SHOW, stderr=True)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 3 and child.pid != os.getpid()
    assert out.split() == ["pid", str(child.pid), "cwd", str(tmp_path), "env", "seen", "argv", "['3',", "'x']"]
    assert err.strip() == "sigterm default True"
    assert os.environ.get("MARK") is None and os.getcwd() != str(tmp_path), "nothing leaks back"


def test_a_forked_script_ends_by_its_signal_and_with_its_traceback(tmp_path):
    sleeper = Forked(code="import time; print('up', flush=True); time.sleep(60)")
    while "up" not in sleeper.output():
        assert sleeper.poll() is None
        time.sleep(0.02)
    sleeper.send_signal(signal.SIGTERM)
    assert sleeper.wait(timeout=30) == -signal.SIGTERM
    script = tmp_path / "fails.py"
    script.write_text("import sys\nassert sys.argv[1:] == ['a'], sys.argv\nraise ValueError('from the script')\n")
    failed = Forked([script, "a"])
    out, _ = failed.communicate(timeout=60)
    assert failed.returncode == 1 and "ValueError: from the script" in out


def test_forked_ranks_get_torchruns_variables_and_a_failure_names_its_rank(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nenv = os.environ\n"
                      "print('rank', env['RANK'], env['LOCAL_RANK'], env['WORLD_SIZE'], env['MASTER_ADDR'])\n"
                      "sys.exit(int(env['RANK']) * int(sys.argv[1]))\n")
    ranks = run_ranks(2, script, "0", timeout=60)
    assert [r.output().split() for r in ranks] == [["rank", "0", "0", "2", "127.0.0.1"],
                                                  ["rank", "1", "1", "2", "127.0.0.1"]]
    assert len({r.pid for r in ranks}) == 2
    with pytest.raises(AssertionError, match=r"(?s)rank 1 exited 3.*rank 1 1 2"):
        run_ranks(2, script, "3", timeout=60)
