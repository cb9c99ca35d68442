"""Code that runs on the nodes: the agent (`python -m skyward.worker`) and the environment builder.

Nothing here imports the client side of skyward except the frame codec and `info`.
"""
