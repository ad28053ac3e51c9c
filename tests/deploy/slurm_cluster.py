"""A real Slurm cluster on this machine, for the deploy tests: Debian's slurmctld, slurmd
and munge, run as root without systemd.

By default (``hosts=True``) the nodes are two real hosts as far as networking goes: each
slurmd runs in a network namespace of its own (`tests.deploy.netns`), started as
``nsenter --net=<ns> unshare --mount --uts sh -c 'mount --bind <hosts> /etc/hosts &&
hostname nX && exec slurmd -N nX'`` (`TestNetwork.exec_argv`), so it and every job step
it forks have their own hostname ``nX``, their own loopback, an address
on a bridge (``NodeAddr``) and a Debian-like /etc/hosts in which ``nX`` itself resolves
to 127.0.1.1 while the other node's name resolves to that node's bridge address. A
program that advertises a loopback address, or its own name as resolved on its own
node, fails here as it would on a real cluster. slurmctld stays in the root namespace
and binds only the bridge address: ``SlurmctldHost=<this host>(<bridge address>)`` with
``CommunicationParameters=NoCtldInAddrAny`` makes it bind what its own name resolves to,
so it runs with a private /etc/hosts that maps this host's name to the bridge address
(`TestNetwork.head_exec_argv`; with the machine's own it would bind 127.0.0.1, without
NoCtldInAddrAny 0.0.0.0). sbatch, scontrol and scancel run from the test process as
usual. ``hosts=False`` keeps the older layout: every slurmd on this host
with ``NodeAddr=127.0.0.1``.

Everything else lives in one temporary folder: a munge key and a private munged on its
own socket (a unix path socket, reachable from every namespace; the system's munge, if
any, is never touched), slurm.conf, spool, state, logs and pid files. `stop` ends
exactly the daemons `start` started, by the pids in their pid files, then whatever is
left in the namespaces (stray job steps), then removes the namespaces and the bridge.

Requeue: ``scontrol requeue`` (`SlurmCluster.requeue`) works, heterogeneous jobs
included (all components go back to pending together). Slurm ends the running job
first (SIGCONT and SIGTERM to all its processes, the batch shell included, SIGKILL after
KillWait, 30 s), then holds it pending until its old credentials expired:
``AuthInfo=...,cred_expire=5`` here instead of 120 s. An idle cluster's backfill then
starts it at the next node ping (``SlurmdTimeout=30``: every 10 s instead of 100 s), so
a requeued job whose processes end on SIGTERM runs again within about 20 s.
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
from tests.deploy.netns import NetnsUnavailable, TestNetwork

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


class SlurmUnavailable(RuntimeError):
    """No Slurm cluster can run here: the packages are missing and this is not root, or
    the test hosts (network namespaces) cannot be made."""


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
    """``nodes`` slurmd nodes n1..nN and one slurmctld on this machine: each node a host
    of its own (a network namespace and hostname) when ``hosts``, else all on loopback."""

    CRED_EXPIRE_S = 5  # a requeued job may start again this + 1 s after it ended
    CPUS_PER_NODE = 8
    SLURMD_TIMEOUT_S = 30  # slurmctld pings the nodes every third of this

    def __init__(self, root: Path, nodes: int = 2, hosts: bool = True):
        self.root = root
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.conf = root / "slurm.conf"
        self.started: list[Path] = []  # pid files of the daemons this object started
        self.head = socket.gethostname().split(".")[0]  # slurmctld's host (this one)
        self.net: TestNetwork | None = TestNetwork(self.nodes, self.head) if hosts else None
        self.hosts: dict[str, str] = {}  # node name -> its address, set by `start`
        self.head_addr = "127.0.0.1"  # slurmctld's address, the bridge's when `hosts`

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

    def conf_lines(self, sock: Path) -> list[str]:
        """slurm.conf, line by line (`start` writes it)."""
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        if self.net is not None:  # each slurmd has a network stack of its own
            node_ports = [node_ports[0]] * len(self.nodes)
        # a node declares at least CPUS_PER_NODE CPUs (config_overrides: slurmd takes
        # the config's word over the machine's): a job asks for the CPUs of the roles
        # it runs, which share a 2-core machine here as they would a real node's cores
        cpus = max(self.CPUS_PER_NODE, os.cpu_count() or 1)
        mem = max(256, _free_mb() // (2 * len(self.nodes)))
        r = self.root
        ctld = f"{self.head}({self.head_addr})" if self.net is not None else self.head
        lines = [
            "ClusterName=sluicetest", f"SlurmctldHost={ctld}", f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[0]}", "AuthType=auth/munge",
            f"AuthInfo=socket={sock},cred_expire={self.CRED_EXPIRE_S}",
            "CredType=cred/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "MpiDefault=none", "SlurmUser=root", "SlurmdUser=root",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none", "ReturnToService=2", "MinJobAge=600",
            "JobRequeue=1",  # batch jobs may be requeued (Slurm's default, made explicit)
            # A requeued job is eligible again cred_expire + 1 s later, but an idle
            # cluster's backfill (the only scheduler that starts heterogeneous jobs)
            # runs only after some job, node or partition change: the next node ping,
            # every SlurmdTimeout/3 (100 s by default), is what starts it.
            f"SlurmdTimeout={self.SLURMD_TIMEOUT_S}",
            "MailProg=/bin/true", "SlurmdParameters=config_overrides",
            "SchedulerParameters=bf_interval=1",  # heterogeneous jobs start by backfill
            f"SlurmctldPidFile={r}/run/slurmctld.pid", f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmdSpoolDir={r}/spool/%n", f"StateSaveLocation={r}/state",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
        ]
        if self.net is not None:  # slurmctld binds the bridge address, not 0.0.0.0
            lines.append("CommunicationParameters=NoCtldInAddrAny")
        for name, port in zip(self.nodes, node_ports, strict=True):
            # as on most clusters, a node is reached by its name (NodeAddr defaults to
            # NodeName), which each host resolves with its own /etc/hosts: on the node
            # itself to 127.0.1.1, elsewhere to its veth address (`netns.hosts_file`)
            hostname = name if self.net is not None else self.head
            addr = "" if self.net is not None else f"NodeAddr={self.hosts[name]} "
            lines.append(f"NodeName={name} NodeHostname={hostname} {addr}Port={port} "
                         f"CPUs={cpus} RealMemory={mem} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        return lines

    def _slurmd_argv(self, name: str) -> list[str]:
        if self.net is None:
            return ["slurmd", "-N", name]
        return self.net.exec_argv(name, ["slurmd", "-N", name])

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        """Network (when ``hosts``), munged, slurmctld, the slurmds; returns once every
        node is idle. Raises `SlurmUnavailable` when namespaces cannot be made here."""
        if self.net is not None:
            try:
                self.net.create()
            except NetnsUnavailable as e:
                raise SlurmUnavailable(f"cannot make the test hosts: {e}") from e
            self.hosts = self.net.addrs
            self.head_addr = self.net.head_addr
        else:
            self.hosts = dict.fromkeys(self.nodes, "127.0.0.1")
        for sub in ("state", "spool", "log", "run", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True)
        sock = self._munge()
        self.conf.write_text("\n".join(self.conf_lines(sock)) + "\n")
        ctld = ["slurmctld"] if self.net is None else self.net.head_exec_argv(["slurmctld"])
        subprocess.run(ctld, check=True, env=self.env, timeout=30, stdin=subprocess.DEVNULL)
        self.started.append(self.root / "run" / "slurmctld.pid")
        for name in self.nodes:
            subprocess.run(self._slurmd_argv(name), check=True, env=self.env, timeout=30,
                           stdin=subprocess.DEVNULL)
            self.started.append(self.root / "run" / f"slurmd-{name}.pid")
        self.wait_idle(timeout_s)
        return self

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, str]:
        """Poll until every node is idle; returns `sinfo`."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.sinfo()
            if states and all(s == "idle" for s in states.values()) \
                    and set(states) == set(self.nodes):
                return states
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
        """Poll until no component is pending, running or on its way back (requeued);
        returns `job`."""
        deadline = time.monotonic() + timeout_s
        while True:
            comps = self.job(job_id)
            if comps and all(c.get("JobState") not in _UNFINISHED for c in comps):
                return comps
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env, timeout=30)
                raise TimeoutError(f"job {job_id} still {comps} after {timeout_s} s")
            time.sleep(1.0)

    def batch_pid(self, job_id: str) -> int | None:
        """The pid of job ``job_id``'s batch shell (the script slurmd runs from its spool
        folder), or None while it is not running. The hosts share this machine's pid
        namespace, so a test can signal it as ``--signal=B:SIG`` would."""
        marker = f"/job{int(job_id):05d}/slurm_script"
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.decode(errors="replace").startswith(str(self.root))
                   and a.decode(errors="replace").endswith(marker) for a in argv):
                return int(proc.name)
        return None

    def requeue(self, job_id: str) -> None:
        """``scontrol requeue``: Slurm ends the running job (SIGCONT and SIGTERM to every
        process of it, SIGKILL after KillWait) and puts it back to pending, all
        components of a heterogeneous job together; it starts again, with
        SLURM_RESTART_COUNT one higher (unset in the first attempt), `CRED_EXPIRE_S`
        + 1 s after it ended at the earliest, at the next node ping at the latest."""
        r = subprocess.run(["scontrol", "requeue", job_id], env=self.env,
                           capture_output=True, text=True, timeout=30)
        if r.returncode:
            raise RuntimeError(f"scontrol requeue {job_id} failed: {r.stderr}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM each daemon started here, by its pid file, and wait for it to go; then
        end whatever is left in the hosts' namespaces (job steps outliving their slurmd)
        and remove the namespaces and the bridge. Safe to call again."""
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
        if self.net is not None:
            self.net.kill_all()
            self.net.cleanup()


# every state in which a job (component) may still run, or run again
_UNFINISHED = frozenset({"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED",
                         "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "SUSPENDED"})

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not our child: nobody reaps it) is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
