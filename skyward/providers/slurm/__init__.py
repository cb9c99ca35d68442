"""Slurm: pools on an HPC cluster's allocation, one agent per node as a job step."""
