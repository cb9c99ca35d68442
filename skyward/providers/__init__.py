"""Providers: where a pool's nodes come from (this machine, SSH hosts, EC2)."""
