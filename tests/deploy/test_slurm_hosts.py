"""The test Slurm cluster (`tests.deploy.slurm_cluster`) really is two hosts: a
heterogeneous job's components run on n1 and n2, each with its own hostname, its own
addresses and the Debian /etc/hosts trap (its own name resolves to 127.0.1.1 on itself,
to its bridge address elsewhere); a step on n2 reaches a listener on n1's address and
not on n1's loopback. And ``scontrol requeue`` of a running heterogeneous job ends it
with SIGTERM (the batch shell and a step on the other node) and brings it back, with
SLURM_RESTART_COUNT set in the second attempt.

Plain bash and Python scripts, no sluice: this checks the cluster the deploy tests
run on, not the rendered job. About 20 s on a 2-core machine once the packages are there
(most of it the requeued job's wait to start again).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.slurm_cluster import SlurmCluster
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]


LISTEN = """\
import socket, sys, os
addr, port_file = sys.argv[1], sys.argv[2]
with socket.create_server((addr, 0)) as s:
    s.settimeout(300)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(s.getsockname()[1]))
    os.rename(port_file + ".tmp", port_file)
    c, peer = s.accept()
    with c:
        line = c.makefile().readline().strip()
        c.sendall(f"pong from {socket.gethostname()}\\n".encode())
print(f"peer={peer[0]}")
print(f"got={line}")
"""

CONNECT = """\
import socket, sys, time, os
addr, port_file = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 300
while not os.path.exists(port_file):
    if time.monotonic() > deadline:
        sys.exit("no port file")
    time.sleep(0.1)
port = int(open(port_file).read())
try:  # n1's loopback is not this host's loopback
    socket.create_connection(("127.0.0.1", port), timeout=10).close()
    print("loopback=connected")
except OSError as e:
    print(f"loopback={type(e).__name__}")
with socket.create_connection((addr, port), timeout=60) as c:
    c.sendall(f"ping from {socket.gethostname()}\\n".encode())
    print(f"reply={c.makefile().readline().strip()}")
"""

# each step: its hostname, its IPv4 addresses, and what n1 resolves to there
FACTS = """\
echo "hostname=$(hostname)"
ip -4 -o addr | awk '{print "addr=" $4}'
getent ahostsv4 n1 | awk 'NR == 1 {print "n1=" $1}'
"""

HOSTS_JOB = """#!/bin/bash
#SBATCH --job-name=hosts
#SBATCH --output=hosts-%j.out
#SBATCH --nodes=1 --ntasks=1 --nodelist=n1 --exclusive
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1 --nodelist=n2 --exclusive
set -eu
srun --het-group=0 bash facts.sh > facts-0.txt
srun --het-group=1 bash facts.sh > facts-1.txt
srun --het-group=0 "$PY" listen.py "$N1_ADDR" port > listen.txt &
listener=$!
srun --het-group=1 "$PY" connect.py "$N1_ADDR" port > connect.txt
wait "$listener"
echo "batch on $(hostname)"
"""


def _facts(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        k, _, v = line.partition("=")
        out.setdefault(k, []).append(v)
    return out


def test_het_job_components_run_on_two_hosts_that_reach_each_other(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    c = slurm
    n1, n2 = c.hosts["n1"], c.hosts["n2"]
    assert n1 != n2 and not n1.startswith("127.") and not c.head_addr.startswith("127.")
    (tmp_path / "job.sh").write_text(HOSTS_JOB)
    (tmp_path / "listen.py").write_text(LISTEN)
    (tmp_path / "connect.py").write_text(CONNECT)
    (tmp_path / "facts.sh").write_text(FACTS)
    job = c.submit(tmp_path / "job.sh", tmp_path, {"PY": sys.executable, "N1_ADDR": n1})
    comps = c.wait_job(job, timeout_s=300)
    out = (tmp_path / f"hosts-{job}.out").read_text() \
        if (tmp_path / f"hosts-{job}.out").exists() else "(no output)"
    assert [(x["JobState"], x["ExitCode"]) for x in comps] == [("COMPLETED", "0:0")] * 2, \
        f"{comps}\n{out}\n{c.logs()}"
    assert [x["NodeList"] for x in comps] == ["n1", "n2"]
    assert out.strip().endswith("batch on n1"), out

    f0, f1 = _facts(tmp_path / "facts-0.txt"), _facts(tmp_path / "facts-1.txt")
    assert f0["hostname"] == ["n1"] and f1["hostname"] == ["n2"]
    assert set(f0["addr"]) == {"127.0.0.1/8", f"{n1}/24"}, f0
    assert set(f1["addr"]) == {"127.0.0.1/8", f"{n2}/24"}, f1
    assert f0["n1"] == ["127.0.1.1"], "on n1 its own name is 127.0.1.1 (the Debian trap)"
    assert f1["n1"] == [n1], "on n2, n1 is n1's bridge address"

    listen = _facts(tmp_path / "listen.txt")
    connect = _facts(tmp_path / "connect.txt")
    assert listen == {"peer": [n2], "got": ["ping from n2"]}, listen
    assert connect == {"loopback": ["ConnectionRefusedError"], "reply": ["pong from n1"]}, \
        connect


REQUEUE_JOB = """#!/bin/bash
#SBATCH --job-name=requeue
#SBATCH --output=requeue-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:TERM@30
#SBATCH --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
n=${SLURM_RESTART_COUNT-unset}
echo "$n $(hostname)" >> attempts.txt
if [ "$n" = unset ]; then  # the first attempt runs until the requeue ends it
    trap 'echo "$(hostname)" > term-batch; exit 143' TERM
    # a step on the other component's node, also told to stop
    srun --het-group=1 bash -c \
        'trap "hostname > term-step; exit 143" TERM; touch step-running; sleep 600 & wait' &
    touch running
    wait
fi
echo "$n" > done
"""


def test_requeued_het_job_runs_again_with_its_restart_count(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    c = slurm
    (tmp_path / "job.sh").write_text(REQUEUE_JOB)
    job = c.submit(tmp_path / "job.sh", tmp_path, {})
    try:
        wait_for(lambda: (tmp_path / "running").exists()
                 and (tmp_path / "step-running").exists()
                 and all(x.get("JobState") == "RUNNING" for x in c.job(job)),
                 300, f"job {job} running", interval_s=0.2)
    except AssertionError:
        subprocess.run(["scancel", job], env=c.env, timeout=30)
        raise
    t0 = time.monotonic()
    c.requeue(job)
    comps = c.wait_job(job, timeout_s=300)
    took = time.monotonic() - t0
    out = (tmp_path / f"requeue-{job}.out").read_text()
    assert [(x["JobState"], x["ExitCode"], x["Restarts"]) for x in comps] == \
        [("COMPLETED", "0:0", "1")] * 2, f"{comps}\n{out}\n{c.logs()}"
    assert (tmp_path / "attempts.txt").read_text().splitlines() == ["unset n1", "1 n1"]
    assert (tmp_path / "done").read_text().strip() == "1", "the first attempt was ended"
    # by SIGTERM, the batch shell on n1 and the step on n2 alike
    assert (tmp_path / "term-batch").read_text().strip() == "n1"
    assert (tmp_path / "term-step").read_text().strip() == "n2"
    assert "DUE TO JOB REQUEUE" in out, out
    assert took < 300, took
