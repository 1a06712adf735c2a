"""The network interface a node talks to the others on, and the variables that pin vLLM, NCCL and Gloo to it.

On a node with several cards (a fast private link and a public one), vLLM guesses its own address and NCCL and
Gloo pick an interface each; a wrong guess is a hang at start. The rig names the interface once: ``NET_IFACE``,
or, with ``auto``, the one whose address the kernel would use to reach the head (the source address of a route
to ``HEAD_ADDR``), and sets ``VLLM_HOST_IP``, ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` from it.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import psutil

from rig.base.console import warn
from rig.base.errors import BadInput, problem


@dataclass(frozen=True)
class Interface:
    name: str
    address: str
    how: str  # "NET_IFACE" or "the route to HEAD_ADDR"

    def env(self) -> dict[str, str]:
        """What vLLM, NCCL and Gloo read to use this interface."""
        return {"VLLM_HOST_IP": self.address, "NCCL_SOCKET_IFNAME": self.name, "GLOO_SOCKET_IFNAME": self.name}


def addresses() -> dict[str, list[str]]:
    """Each interface's IPv4 addresses."""
    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def source_address(head: str, port: int) -> str:
    """The local address a connection to the head leaves from (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((head, port))
        return sock.getsockname()[0]


def choose(wanted: str, head: str, port: int) -> Interface:
    """``NET_IFACE`` (a name, or ``auto``) as an interface with its address; exit 2 when there is none."""
    table = addresses()
    shown = ", ".join(f"{n} ({', '.join(a) or 'no IPv4'})" for n, a in sorted(table.items()))
    if wanted != "auto":
        if not table.get(wanted):
            raise BadInput(problem(f"NET_IFACE={wanted}", f"an interface with an IPv4 address, one of: {shown}",
                                   "no such interface" if wanted not in table else "no IPv4 address on it",
                                   "set NET_IFACE to one of them, or to auto"))
        return Interface(wanted, table[wanted][0], "NET_IFACE")
    try:
        addr = source_address(head, port)
    except OSError as exc:
        raise BadInput(problem(f"HEAD_ADDR={head}", "an address this node has a route to", f"none ({exc.strerror})",
                               "check the address, or set NET_IFACE to the interface that reaches the head")) from None
    name = next((n for n, addrs in table.items() if addr in addrs), None)
    if name is None:
        raise BadInput(problem(f"the route to HEAD_ADDR={head}", f"an interface holding its source address {addr}",
                               f"none of: {shown}", "set NET_IFACE to the interface that reaches the head"))
    return Interface(name, addr, "the route to HEAD_ADDR")


def private(address: str) -> bool:
    """Loopback, link-local or a private range: where unencrypted node-to-node traffic belongs."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return ip.is_private or ip.is_loopback or ip.is_link_local


def warn_if_public(address: str, what: str) -> None:
    """A warning when ``address`` is not :func:`private`: the traffic between nodes is unencrypted."""
    if not private(address):
        warn(f"{what} {address} is not a private address: the traffic between nodes is unencrypted and can run "
             "code (vLLM's own docs say so); keep it on a private network, or firewall the ports")
