"""The Slurm provider as the registry knows it: the ``slurm`` extra, its ``skyward run`` flags
and where ``skyward ls``/``down`` look (a login node, or this machine)."""

from skyward.providers.registry import Option, ProviderEntry

ENTRY = ProviderEntry(
    "slurm",
    "skyward.providers.slurm.provider",
    "Slurm",
    "slurm",
    options=(
        Option("--partition", "partition", "the partition"),
        Option("--account", "account", "the account"),
        Option(
            "--time-limit",
            "time_limit",
            "the allocation's time limit as Slurm writes it, "
            "e.g. 2:00:00 (a bare number is minutes, as for sbatch)",
        ),
        Option(
            "--login", "login", "a login node over SSH, user@host (default: here)", listing=True
        ),
    ),
    position=40,
)
