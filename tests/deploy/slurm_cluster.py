"""A real Slurm cluster on this machine, for the deploy tests: Debian's slurmctld, slurmd
and munge, run as root without systemd, on loopback ports of their own.

Two nodes (``slurmd -N n1`` and ``-N n2``, each with the machine's CPUs and its own
port; Debian's build accepts several slurmd on one host) so a heterogeneous job really
has two components on two nodes. Everything lives in one temporary folder: a munge key
and a private munged on its own socket (the system's munge, if any, is never touched),
slurm.conf, spool, state, logs and pid files. `stop` ends exactly the daemons `start`
started, by the pids in their pid files, and waits until they are gone.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from pipeline.ports import free_ports

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


class SlurmUnavailable(RuntimeError):
    """The packages are missing and cannot be installed here (not root)."""


def ensure_installed(timeout_s: float = 900.0) -> None:
    """Install Debian's Slurm and munge packages when any of their programs is missing
    (as root, with apt-get; about a minute)."""
    if all(shutil.which(p) for p in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmctld/slurmd/munged are not installed and this is not "
                               "root: apt-get install -y " + " ".join(PACKAGES))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, timeout=timeout_s,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], check=True, env=env,
                   timeout=timeout_s, stdout=subprocess.DEVNULL)


def _free_mb() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"MemAvailable:\s+(\d+)", text)[1]) // 1024  # type: ignore[index]


class SlurmCluster:
    """``nodes`` slurmd nodes n1..nN and one slurmctld, all on this host."""

    def __init__(self, root: Path, nodes: int = 2):
        self.root = root
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.conf = root / "slurm.conf"
        self.started: list[Path] = []  # pid files of the daemons this object started

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _munge(self) -> Path:
        d = self.root / "munge"
        d.mkdir(mode=0o700, parents=True)
        key = d / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        sock = d / "munge.sock"
        subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}",
                        f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                        f"--seed-file={d / 'munged.seed'}"], check=True, timeout=30)
        self.started.append(d / "munged.pid")
        return sock

    def _write_conf(self, sock: Path) -> None:
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        cpus = os.cpu_count() or 1
        mem = max(256, _free_mb() // (2 * len(self.nodes)))
        host = socket.gethostname().split(".")[0]
        r = self.root
        for sub in ("state", "spool", "log", "run"):
            (r / sub).mkdir()
        lines = [
            "ClusterName=sluicetest", f"SlurmctldHost={host}", f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[0]}", "AuthType=auth/munge", f"AuthInfo=socket={sock}",
            "CredType=cred/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "MpiDefault=none", "SlurmUser=root", "SlurmdUser=root",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none", "ReturnToService=2", "MinJobAge=600",
            "MailProg=/bin/true",
            "SchedulerParameters=bf_interval=1",  # heterogeneous jobs start by backfill
            f"SlurmctldPidFile={r}/run/slurmctld.pid", f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmdSpoolDir={r}/spool/%n", f"StateSaveLocation={r}/state",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
        ]
        for name, port in zip(self.nodes, node_ports, strict=True):
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 "
                         f"Port={port} CPUs={cpus} RealMemory={mem} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        sock = self._munge()
        self._write_conf(sock)
        subprocess.run(["slurmctld"], check=True, env=self.env, timeout=30)
        self.started.append(self.root / "run" / "slurmctld.pid")
        for name in self.nodes:
            subprocess.run(["slurmd", "-N", name], check=True, env=self.env, timeout=30)
            self.started.append(self.root / "run" / f"slurmd-{name}.pid")
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.sinfo()
            if states and all(s == "idle" for s in states.values()) \
                    and set(states) == set(self.nodes):
                return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes not idle within {timeout_s} s: {states}\n"
                                   f"{self.logs()}")
            time.sleep(0.2)

    def sinfo(self) -> dict[str, str]:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env,
                           capture_output=True, text=True, timeout=30)
        return dict(line.split() for line in r.stdout.splitlines() if line.strip())

    def logs(self, n: int = 20) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            out.append(f"== {f.name}\n" + "\n".join(f.read_text().splitlines()[-n:]))
        return "\n".join(out)

    def submit(self, script: Path, cwd: Path, env: dict[str, str]) -> str:
        r = subprocess.run(["sbatch", "--parsable", str(script)], cwd=cwd,
                           env={**self.env, **env}, capture_output=True, text=True, timeout=60)
        if r.returncode:
            raise RuntimeError(f"sbatch failed: {r.stderr}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job` of every component, as key=value dicts."""
        r = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env,
                           capture_output=True, text=True, timeout=30)
        return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
                for line in r.stdout.splitlines() if line.strip()]

    def wait_job(self, job_id: str, timeout_s: float) -> list[dict[str, str]]:
        """Poll until no component is pending or running; returns `job`."""
        deadline = time.monotonic() + timeout_s
        while True:
            comps = self.job(job_id)
            if comps and all(c.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING",
                                                        "COMPLETING") for c in comps):
                return comps
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env, timeout=30)
                raise TimeoutError(f"job {job_id} still {comps} after {timeout_s} s")
            time.sleep(1.0)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM each daemon started here, by its pid file, and wait for it to go."""
        pids = []
        for pidfile in reversed(self.started):
            try:
                pid = int(pidfile.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        for pid in pids:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.started.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not our child: nobody reaps it) is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
