"""What every provider whose nodes are remote hosts shares: connect, bootstrap, data.

SSH, AWS and GCP reach their hosts over SSH; Slurm runs the same commands as srun job steps
(`skyward.providers.slurm.steps`), a `Host` too.
"""
