"""A rendezvous store in its own process, for torchrun's c10d backend in `bench/recovery.py`.

torchrun's c10d rendezvous normally lives inside one of the agents; if that agent's node is
the one lost, the survivor can never rendezvous again. Hosting the store apart (as a real
cluster would, next to etcd) lets the node-loss baseline measure torchrun's own recovery.
Prints `ready <port>` once it listens, then serves until killed.
"""

from __future__ import annotations

import argparse
import signal
import sys
from datetime import timedelta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()

    from torch.distributed import TCPStore

    store = TCPStore(
        args.host,
        args.port,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=300),
    )
    print(f"ready {store.port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


if __name__ == "__main__":
    sys.exit(main())
