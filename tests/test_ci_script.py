"""`.ci/run`'s cleanup trap, run under the script's own shell options: a green run must exit 0 and a
red one keep its status (a `kill` with no job left once turned a green CI run into exit 2)."""
import pathlib
import subprocess

import pytest

CI_RUN = pathlib.Path(__file__).resolve().parents[1] / ".ci" / "run"


def _trap_line():
    lines = [ln for ln in CI_RUN.read_text().splitlines() if ln.startswith("trap ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("job_left", [False, True])
@pytest.mark.parametrize("last_status", [0, 3])
def test_cleanup_trap_keeps_the_run_status(tmp_path, last_status, job_left):
    work = tmp_path / "work"
    work.mkdir()
    script = "\n".join([
        "set -euo pipefail",
        f"work={work}",
        _trap_line(),
        "sleep 0.01 &",  # a background job already waited for, as the oldest install is
        "wait $!",
        "sleep 30 &" if job_left else ":",  # one still running, which the trap must stop
        f"( exit {last_status} )",
    ])
    done = subprocess.run(["bash", "-c", script], timeout=20)
    assert done.returncode == last_status
    assert not work.exists()
