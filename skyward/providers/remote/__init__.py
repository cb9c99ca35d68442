"""What every provider whose nodes are reached over SSH shares: connect, bootstrap, data."""
