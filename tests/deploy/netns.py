"""Test hosts as Linux network namespaces on this one machine, so a test can run daemons
that talk to each other over a real (virtual) network instead of all sharing loopback.

Why: processes that share one network stack hide a whole class of bugs. A program that
advertises ``gethostname()``'s address, or binds 127.0.0.1 and expects another host to
reach it, works when every "host" is the same loopback and breaks on a real cluster.
Each namespace here has its own interfaces and its own loopback, so 127.0.0.1 on one
host is not reachable from another, and each has a Debian-like ``/etc/hosts`` in which
the host's *own* name resolves to 127.0.1.1 (what Debian and Ubuntu installers write):
a daemon that resolves its own name to find the address to advertise gets a loopback
address, exactly as on those clusters.

Layout, for hosts ``n1..nN`` and a controller that stays in the root namespace::

    root namespace: bridge <tag>br, 10.R.0.1/24 (the controller's address)
    namespace <tag>-nI: veth <tag>pI, 10.R.0.(I+1)/24, lo up, default route via 10.R.0.1
    root end of that veth: <tag>vI, enslaved to the bridge (traffic between hosts is
                           switched at layer 2 by the bridge, never routed or NATed)

`TestNetwork.exec_argv` runs a command as on one host: in its network namespace, with
its own hostname (UTS namespace) and with ``/etc/netns/<ns>/hosts`` bind-mounted over
``/etc/hosts`` (as ``ip netns exec`` would), for it and everything it starts. Only
root (CAP_NET_ADMIN and CAP_SYS_ADMIN) can do any of this: `TestNetwork.create` raises
`NetnsUnavailable` otherwise. `TestNetwork.cleanup` removes everything this object made
(namespaces, veths, bridge, its /etc/netns folders), tolerates a partial setup and can
be called any number of times.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

NETNS_ETC = Path("/etc/netns")
HEAD = "head"  # /etc/netns/<tag>-head/hosts: the controller's hosts file (no namespace)


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no `ip`, or the kernel refuses)."""


@dataclass(frozen=True)
class Host:
    """One test host: its name (the UTS hostname its processes should use), the network
    namespace it lives in, and its address on the bridge."""

    name: str
    netns: str
    addr: str
    veth: str  # the root-namespace end of its veth pair (the other end is in netns)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine already has an address or a route in (all
    routing tables), so a new bridge subnet can avoid them."""
    nets = []
    for args in (("-4", "-o", "addr", "show"), ("-4", "route", "show", "table", "all")):
        for line in _ip(*args, check=False).stdout.splitlines():
            for word in line.split():
                try:
                    net = ipaddress.ip_network(word, strict=False)
                except ValueError:
                    continue
                if isinstance(net, ipaddress.IPv4Network) and net.prefixlen > 0:
                    nets.append(net)
    return nets


def pick_subnet(start: int | None = None) -> int:
    """R such that 10.R.0.0/24 overlaps no address or route here. The search starts at a
    pid-derived R so that concurrent test processes rarely try the same one."""
    used = _used_networks()
    first = (os.getpid() % 150) if start is None else start
    for k in range(150):
        r = 100 + (first + k) % 150  # 10.100..10.249: clear of the usual 10.0/10.1/10.96
        net = ipaddress.ip_network(f"10.{r}.0.0/24")
        if not any(net.overlaps(u) for u in used):
            return r
    raise NetnsUnavailable("no free 10.R.0.0/24 subnet for the test bridge")


def hosts_file(own: str, others: dict[str, str], controller: str, controller_addr: str) -> str:
    """A Debian-like /etc/hosts for host ``own``: its own name on 127.0.1.1 (the trap),
    every other host on its veth address, the controller on the bridge address."""
    lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{own}"]
    lines += [f"{addr}\t{name}" for name, addr in others.items() if name != own]
    if controller not in others and controller != own:
        lines.append(f"{controller_addr}\t{controller}")
    return "\n".join(lines) + "\n"


def _ns_pids(netns: str) -> list[int]:
    r = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie nobody reaps is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@dataclass
class TestNetwork:
    """A bridge in the root namespace and one namespace per name in ``names``.

    ``controller`` is the name by which the hosts reach the root namespace (where the
    test process and, say, slurmctld run): it resolves to the bridge address in every
    host's /etc/hosts. Names of interfaces and namespaces carry ``tag`` (default: from
    the pid) so concurrent test processes do not collide; interface names stay within
    Linux's 15 characters.
    """

    __test__ = False  # not a pytest test class, despite the name

    names: Sequence[str]
    controller: str
    tag: str = field(default_factory=lambda: f"sl{os.getpid() % 100000}")
    subnet: int | None = None  # R of 10.R.0.0/24, picked by `create` when None
    hosts: dict[str, Host] = field(default_factory=dict, init=False)
    _made_ns: list[str] = field(default_factory=list, init=False, repr=False)
    _made_links: list[str] = field(default_factory=list, init=False, repr=False)
    _made_dirs: list[Path] = field(default_factory=list, init=False, repr=False)
    _made_etc_netns: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.tag) + 4 > 15 or len(self.names) > 250:
            raise ValueError(f"tag {self.tag!r} too long or too many hosts")

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def head_addr(self) -> str:
        """The bridge's address: how the hosts reach the root namespace."""
        if self.subnet is None:
            raise RuntimeError("create() first")
        return f"10.{self.subnet}.0.1"

    @property
    def addrs(self) -> dict[str, str]:
        """Host name -> its address."""
        return {h.name: h.addr for h in self.hosts.values()}

    def create(self) -> TestNetwork:
        """Make the bridge, the namespaces, their veths, routes and hosts files. On any
        failure, undo what was made and raise `NetnsUnavailable`."""
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (CAP_NET_ADMIN); "
                                   f"this is uid {os.geteuid()}")
        if not shutil.which("ip"):
            raise NetnsUnavailable("the `ip` command (iproute2) is missing")
        try:
            self._create()
        except BaseException:
            self.cleanup()
            raise
        return self

    def _create(self) -> None:
        if self.subnet is None:
            self.subnet = pick_subnet()
        r = self.subnet
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        _ip("addr", "add", f"{self.head_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names, start=1):
            ns, veth, peer = f"{self.tag}-{name}", f"{self.tag}v{i}", f"{self.tag}p{i}"
            addr = f"10.{r}.0.{i + 1}"
            _ip("netns", "add", ns)
            self._made_ns.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            self._made_links.append(veth)
            _ip("link", "set", peer, "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", peer)
            _ip("-n", ns, "link", "set", peer, "up")
            _ip("-n", ns, "route", "add", "default", "via", self.head_addr)
            self.hosts[name] = Host(name, ns, addr, veth)
        if not NETNS_ETC.exists():
            NETNS_ETC.mkdir(mode=0o755)
            self._made_etc_netns = True
        addrs = self.addrs
        for h in self.hosts.values():
            d = NETNS_ETC / h.netns
            d.mkdir()
            self._made_dirs.append(d)
            (d / "hosts").write_text(hosts_file(h.name, addrs, self.controller,
                                                self.head_addr))
        d = NETNS_ETC / f"{self.tag}-{HEAD}"
        d.mkdir()
        self._made_dirs.append(d)
        (d / "hosts").write_text(  # the controller's own name on the bridge address
            "\n".join(["127.0.0.1\tlocalhost", f"{self.head_addr}\t{self.controller}",
                       *(f"{a}\t{n}" for n, a in addrs.items())]) + "\n")
        self._check_bridge_forwards()

    def _check_bridge_forwards(self, timeout_s: float = 30.0) -> None:
        """Fail early, with a clear message, if a firewall (br_netfilter with a DROP
        FORWARD policy) or the kernel keeps host-to-host traffic off the bridge: each
        host must reach the bridge address and the next host over TCP."""
        if len(self.hosts) < 1:
            return
        hosts = list(self.hosts.values())
        for a, b in zip(hosts, hosts[1:] + hosts[:1], strict=True):
            code = ("import socket,sys\n"
                    "s=socket.socket(); s.bind((sys.argv[1],0)); s.listen()\n"
                    "print(s.getsockname()[1], flush=True); c,_=s.accept(); c.close()")
            srv = subprocess.Popen(self.exec_argv(b.name, [_python(), "-c", code, b.addr]),
                                   stdout=subprocess.PIPE, text=True)
            try:
                assert srv.stdout is not None
                port = srv.stdout.readline().strip()
                probe = ("import socket,sys\n"
                         "socket.create_connection((sys.argv[1],int(sys.argv[2])),"
                         "timeout=10).close()")
                rc = subprocess.run(self.exec_argv(a.name, [_python(), "-c", probe, b.addr,
                                                            port]),
                                    capture_output=True, text=True, timeout=timeout_s)
                if rc.returncode:
                    raise NetnsUnavailable(f"{a.name} cannot reach {b.name} ({b.addr}) over "
                                           f"the bridge {self.bridge}: {rc.stderr[-500:]} "
                                           "(a firewall FORWARD policy with br_netfilter?)")
            finally:
                srv.kill()
                srv.wait(timeout=30)

    def exec_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run as on host ``name``: in its network namespace, with its hostname
        (a UTS namespace of its own) and its /etc/hosts, inherited by all it starts.

        Not ``ip netns exec``: that also remounts /sys for the namespace, which hides
        the cgroup mounts under /sys/fs/cgroup that slurmd (22.05) refuses to start
        without. So: nsenter the network namespace, unshare a private mount and UTS
        namespace, bind-mount the host's hosts file over /etc/hosts (what ``ip netns
        exec`` does with /etc/netns/<ns>/hosts) and set the hostname.
        """
        h = self.hosts[name]
        script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--mount", "--uts",
                "--propagation", "private", "sh", "-c", script, "sh",
                str(NETNS_ETC / h.netns / "hosts"), h.name, *argv]

    def head_exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in the root network namespace (as the controller) but with an
        /etc/hosts in which the controller's name is the bridge address, not loopback.

        For a daemon that binds the address its own name resolves to (slurmctld with
        ``CommunicationParameters=NoCtldInAddrAny``): with this machine's /etc/hosts it
        would bind 127.0.0.1, which no host can reach; with 0.0.0.0 it would listen on
        every interface of this machine. Nothing outside this process tree changes."""
        script = 'mount --bind "$1" /etc/hosts && shift && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                str(NETNS_ETC / f"{self.tag}-{HEAD}" / "hosts"), *argv]

    def pids(self) -> dict[str, list[int]]:
        """Processes now in each host's namespace (every one of them was started by us:
        nobody else knows these namespaces)."""
        return {h.name: _ns_pids(h.netns) for h in self.hosts.values()}

    def kill_all(self, timeout_s: float = 10.0) -> list[int]:
        """SIGTERM, then SIGKILL after ``timeout_s``, every process left in our
        namespaces (stray job steps, say); returns their pids."""
        pids = [p for ns in self._made_ns for p in _ns_pids(ns)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + timeout_s
            while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
        return pids

    def cleanup(self) -> None:
        """Remove what `create` made: namespaces (their veth ends go with them), the
        root-side veths, the bridge, the /etc/netns folders. Safe after a partial
        `create` and when called again."""
        for ns in self._made_ns:
            _ip("netns", "del", ns, check=False)
        for link in reversed(self._made_links):
            if _ip("link", "show", link, check=False).returncode == 0:
                _ip("link", "del", link, check=False)
        for d in self._made_dirs:
            shutil.rmtree(d, ignore_errors=True)
        if self._made_etc_netns:
            try:
                NETNS_ETC.rmdir()  # only if empty: another process may use it now
            except OSError:
                pass
        self._made_ns.clear()
        self._made_links.clear()
        self._made_dirs.clear()
        self._made_etc_netns = False


def _python() -> str:
    """A Python for the reachability probe: the one running this module."""
    return sys.executable
