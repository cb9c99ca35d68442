"""The AWS provider as the registry knows it: the ``aws`` extra, its ``skyward run`` flags and
where ``skyward ls``/``down`` look (a region, an AWS profile)."""

from skyward.providers.registry import Option, ProviderEntry

ENTRY = ProviderEntry(
    "aws",
    "skyward.providers.aws.provider",
    "AWS",
    "aws",
    options=(
        Option("--region", "region", "the region (default: the standard resolution)", listing=True),
        Option("--profile", "profile", "the AWS profile", run=False, listing=True),
        Option("--instance-type", "instance_type", "the instance type"),
        Option("--spot", "spot", "spot instances or VMs", "switch"),
        Option("--user", "user", "the login user"),
    ),
    position=20,
)
