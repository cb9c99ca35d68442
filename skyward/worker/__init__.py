"""Code that runs on the nodes: the agent (`python -m skyward.worker`) and the environment builder.

Nothing here imports the client side of skyward (client/, providers/, console/, the pool): only
the wire (`transport.frames`, `messages`, `agentwire`), the hook runner and what a
node reports with (`info`, `reports`, `preemption`, `errors`, `version`).
"""
