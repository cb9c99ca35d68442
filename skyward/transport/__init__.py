"""Byte streams to a node's agent and the frame codec that runs over them."""
