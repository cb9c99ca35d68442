"""The GCP provider as the registry knows it: the ``gcp`` extra, its ``skyward run`` flags and
where ``skyward ls``/``down`` look (a project, a zone)."""

from skyward.providers.registry import Option, ProviderEntry

ENTRY = ProviderEntry(
    "gcp",
    "skyward.providers.gcp.provider",
    "GCP",
    "gcp",
    options=(
        Option(
            "--project", "project", "the project (default: the standard resolution)", listing=True
        ),
        Option("--zone", "zone", "the zone (default: the standard resolution)", listing=True),
        Option("--spot", "spot", "spot instances or VMs", "switch"),
    ),
    position=30,
)
