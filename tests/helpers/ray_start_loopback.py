"""`ray start` for a SECOND node of a test cluster that lives on 127.0.0.1 only (tests/helpers/ray_local.py).

Ray's C++ servers bind 127.0.0.1 only when the node IP is exactly "127.0.0.1"
(else 0.0.0.0).  `ray start` keeps "127.0.0.1" only with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and with that setting it refuses
`--address` (worker nodes): "Multi-node Ray clusters are not supported on
Windows and OSX".  This wrapper runs the unmodified `ray start` CLI with two
in-process changes: the guard sees "clusters enabled", and localhost is not
rewritten into the machine's routable IP.  Child processes keep the env
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), exactly like the head's.

This relies on two private names of Ray 2.60 (`ray._private`): re-check it when Ray is upgraded. Real clusters
never need it: their nodes have routable addresses and run the stock `ray start --address`.

usage: python ray_start_loopback.py start --address=127.0.0.1:PORT --node-ip-address=127.0.0.1 ...
"""

import sys

import ray._private.ray_constants as ray_constants
import ray._private.services as services
from ray._raylet import is_localhost


def _keep_loopback(host: str) -> str:
    if not host:
        raise ValueError(f"Malformed host: {host}")
    return "127.0.0.1" if is_localhost(host) else host


ray_constants.ENABLE_RAY_CLUSTER = True  # pass the multi-node guard in `ray start`
services.resolve_ip_for_localhost = _keep_loopback  # ...without leaving loopback

if __name__ == "__main__":
    from ray.scripts.scripts import main

    sys.argv[0] = "ray"
    sys.exit(main())
