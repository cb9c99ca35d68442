"""Providers: where a pool's nodes come from (this machine, SSH hosts, EC2 instances, Compute
Engine VMs and TPU slices, a Slurm allocation)."""
