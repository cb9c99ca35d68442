"""The client's machinery: what a pool does between the user's call and the nodes' agents."""
