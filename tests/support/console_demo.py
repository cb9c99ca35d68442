"""A 2-node pool for the console tests, run as a program (in a tmux pane, or with pipes).

``python console_demo.py CONFIG`` where CONFIG is JSON: ``provider`` ("local" or "ssh", with
``hosts``, ``key``, ``known_hosts`` and ``python`` for SSH), ``log`` (a file that gets the
``skyward`` logger's records), ``stream_output``, ``seconds`` (how long the call runs).
"""

from __future__ import annotations

import json
import logging
import sys
import time

import skyward as sky


@sky.compute
def work(seconds: float) -> int:
    node = sky.instance_info().node
    for step in range(3):
        print(f"step {step} of node {node}", flush=True)
        sky.report({"loss": 1.0 / (step + 1), "step": step})
        time.sleep(seconds / 3)
    return node


def main(config: dict[str, object]) -> None:
    if config.get("log"):
        handler = logging.FileHandler(str(config["log"]))
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logging.getLogger("skyward").addHandler(handler)
        logging.getLogger("skyward").setLevel(logging.INFO)
    provider: sky.Local | sky.SSH = sky.Local()
    if config["provider"] == "ssh":
        provider = sky.SSH(
            list(config["hosts"]),  # type: ignore[call-overload]
            user="root",
            key=str(config["key"]),
            known_hosts=str(config["known_hosts"]),
            python=str(config["python"]),
        )
    with sky.ComputePool(
        provider=provider, nodes=2, stream_output=bool(config.get("stream_output", True))
    ) as pool:
        print("client: the pool is ready")
        time.sleep(0.8)  # the region shows both nodes ready
        print("client: results", work(float(config.get("seconds", 1.5))) @ pool)  # type: ignore[arg-type]
        time.sleep(0.5)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
