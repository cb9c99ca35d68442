"""Detached runs: a script that runs on a pool's nodes after the client is gone.

`submit` starts one (``skyward run --detach``), `Run` follows it from any later process on
this machine (``skyward logs``, ``skyward status``, ``skyward stop``). The nodes hold the run
(`skyward.worker.supervisor`); the client keeps only a record (`record`) and reaches the
nodes over the paths a live pool uses (`reach`). See docs/detach.md.
"""
