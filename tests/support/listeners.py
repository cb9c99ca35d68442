"""What listens on a pool's coordinator port, seen from inside a node's own network."""

from __future__ import annotations

import subprocess

import skyward as sky


@sky.compute
def listeners(port_name: str) -> tuple[str, list[str]]:
    """The pool's coordinator address for `port_name` (``jax``, ``torch``) and the local
    addresses listening on its port in this node's network (`ss`)."""
    info = sky.instance_info()
    port = info.ports[port_name]
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    # gRPC binds an IPv4 address as an IPv4-mapped IPv6 one: [::ffff:10.0.0.1]:port
    found = [line.split()[3].replace("[::ffff:", "").replace("]", "") for line in out.splitlines()]
    return f"{info.head_addr}:{port}", found
