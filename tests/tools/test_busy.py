"""scripts/busy.py: the command's exit status, its CPU limit (a real cgroup), and bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BUSY = Path(__file__).resolve().parents[2] / "scripts" / "busy.py"

#: Run inside the limit: the quota and period of the cgroup this process is in, as "quota period".
OWN_LIMIT = """
import os
for line in open("/proc/self/cgroup"):
    number, controllers, path = line.rstrip("\\n").split(":", 2)
    if number == "0" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        print(open(f"/sys/fs/cgroup{path}/cpu.max").read().strip(), path)
    elif "cpu" in controllers.split(","):
        base = f"/sys/fs/cgroup/cpu{path}"
        print(open(f"{base}/cpu.cfs_quota_us").read().strip(), open(f"{base}/cpu.cfs_period_us").read().strip(),
              path)
"""


def busy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUSY), *args], capture_output=True, text=True, timeout=60)


def _cgroup_dir(path: str = "") -> str:
    """The directory of the cgroup at ``path`` (as /proc/self/cgroup names it) in the cpu hierarchy."""
    v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    return f"/sys/fs/cgroup{'' if v2 else '/cpu'}{path}"


def _cgroup_writable() -> bool:
    return os.geteuid() == 0 and os.access(_cgroup_dir(), os.W_OK)


@pytest.mark.timeout(90)
def test_the_exit_status_is_the_commands_beside_burners():
    done = busy("-n", "1", "--", sys.executable, "-c", "raise SystemExit(3)")
    assert done.returncode == 3, done.stderr


@pytest.mark.timeout(90)
@pytest.mark.skipif(not _cgroup_writable(), reason="needs root and a writable cgroup cpu controller")
def test_cpus_runs_the_command_in_a_cgroup_of_that_quota_removed_after():
    done = busy("-n", "0", "--cpus", "0.3", "--", sys.executable, "-c", OWN_LIMIT)
    assert done.returncode == 0, done.stderr
    quota, period, path = done.stdout.split()
    assert (quota, period) == ("30000", "100000") and path.startswith("/gputq-busy-"), done.stdout
    assert not os.path.exists(_cgroup_dir(path))  # removed once the command ended
    assert done.stderr == ""


@pytest.mark.timeout(90)
@pytest.mark.skipif(not _cgroup_writable(), reason="needs root and a writable cgroup cpu controller")
def test_cpus_waits_for_what_the_command_left_behind_before_removing_its_cgroup(tmp_path):
    """The command returns, leaving a child in the cgroup that exits only when the test lets it (a suite's server
    still shutting down): busy.py keeps the cgroup while the child is in it, then removes it, with nothing said."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    child = "subprocess.Popen([sys.executable, '-c', 'import os; open(os.environ[\"GATE\"]).read(1)'])"
    left = f"import subprocess, sys; {child}; {OWN_LIMIT}"
    with subprocess.Popen([sys.executable, str(BUSY), "-n", "0", "--cpus", "0.5", "--", sys.executable, "-c", left],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "GATE": str(gate)}) as run:
        path = run.stdout.readline().split()[-1]  # the command's line: it has returned or is about to
        assert path.startswith("/gputq-busy-") and os.path.exists(_cgroup_dir(path))  # the child holds it
        with open(gate, "w") as opened:  # meets the child's open: it reads this and exits
            opened.write("x")
        out, err = run.communicate(timeout=60)
    assert run.returncode == 0 and err == "" and out == "", err
    assert not os.path.exists(_cgroup_dir(path))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("args, message", [
    (["--cpus", "0", "--", "true"], "--cpus must be between 0.01"),
    (["--cpus", "4096", "--", "true"], "--cpus must be between 0.01"),
    (["-n", "-1", "--", "true"], "a burner count >= 0"),
    ([], "give a command after --"),
])
def test_bad_input_exits_2_naming_it(args, message):
    done = busy(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
