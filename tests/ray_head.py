"""A Ray cluster of one node with a Ray Client server, for tests that connect with ray://.

Run as ``python -m tests.ray_head STATE_DIR`` from the checkout: starts Ray (2 CPUs, one
declared GPU, a 256 MB object store, its state in STATE_DIR, listening on the
loopback only), serves Ray Client on a free port of 127.0.0.1, prints ``ready
PORT``, and stops both when its standard input closes, so the test that
started it cannot leave it behind.

The port is picked only once Ray is up, just before the server binds it: a
port picked before the ten seconds Ray takes to start was free for anyone
else on the machine to take in the meantime.
"""

from __future__ import annotations

import socket
import sys

import ray
from ray.util.client.server import server as client_server

from tests.local_ray import local_ray_args, start_local_ray


def main() -> int:
    state = sys.argv[1]
    start_local_ray(**local_ray_args(state, gpus=1))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # This process is already a driver of the cluster, so a client's session
    # needs no ray.init of its own: its tasks run in this driver's job.
    server = client_server.serve("127.0.0.1", port, ray_connect_handler=lambda *a, **k: None)
    print(f"ready {port}", flush=True)
    sys.stdin.read()
    server.stop(0)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
