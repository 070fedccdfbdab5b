"""Two emulated hosts on one machine: network namespaces joined by a rate-limited veth pair.

Each "host" is a network namespace with one end of a veth pair; `tc qdisc ... tbf` on both ends
limits the link (it plays the inter-node network, while the devices inside one JAX process talk in
memory and play NVLink). JAX's gloo collectives advertise the address the hostname resolves to, so
each namespace gets its own /etc/netns/NAME/hosts mapping the hostname to its veth address
(`ip netns exec` bind-mounts it over /etc/hosts).

Needs root. Everything it creates (namespaces, links, /etc/netns files) is removed on exit, also
after an error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from pathlib import Path

SUBNET = "10.77.0"  # private addresses that exist only inside these namespaces


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def require_root() -> None:
    if os.geteuid() != 0:
        raise SystemExit("error: the emulated cluster needs root (network namespaces and tc); "
                         "run it as root, e.g. sudo python benchmarks/emulated_cluster.py")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"error: '{tool}' is missing; install iproute2")


class Cluster:
    """Namespaces `{prefix}0..{prefix}{n-1}`; host i has address SUBNET.(i+1). Two hosts only:
    one veth pair is the whole inter-host network."""

    def __init__(self, prefix: str = "basp-host", hosts: int = 2):
        if hosts != 2:
            raise ValueError("the emulated cluster joins exactly two hosts with one veth pair")
        self.names = [f"{prefix}{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.links = [f"bveth{i}" for i in range(hosts)]
        self.hostname = socket.gethostname()

    def __enter__(self) -> "Cluster":
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _create(self) -> None:
        self.remove()  # leftovers of an interrupted run
        for name in self.names:
            _run("ip", "netns", "add", name)
        _run("ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for name, link, address in zip(self.names, self.links, self.addresses):
            _run("ip", "link", "set", link, "netns", name)
            _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", link)
            _run("ip", "-n", name, "link", "set", link, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(
                f"127.0.0.1 localhost\n{address} {self.hostname}\n"
                + "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
            )

    def set_rate(self, mbit: float | None) -> None:
        """Limit each direction of the link to `mbit` Mbit/s (None: unthrottled)."""
        for name, link in zip(self.names, self.links):
            subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "del", "dev", link, "root"],
                           capture_output=True)
            if mbit is not None:
                # burst: at least one MTU and ~10 ms at the rate; latency bounds the queue.
                burst = max(int(mbit * 1e6 / 8 / 100), 16 * 1024)
                _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", link, "root", "tbf",
                     "rate", f"{mbit}mbit", "burst", str(burst), "latency", "500ms")

    def command(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]

    def remove(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(Path("/etc/netns") / name)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
