"""The SSH provider as the registry knows it: the ``ssh`` extra and its ``skyward run`` flags."""

from skyward.providers.registry import Option, ProviderEntry

ENTRY = ProviderEntry(
    "ssh",
    "skyward.providers.ssh.provider",
    "SSH",
    "ssh",
    options=(
        Option("--hosts", "hosts", "comma-separated hosts ('user@host:port' each)", "list"),
        Option("--user", "user", "the login user"),
        Option("--key", "key", "the private key file"),
    ),
    position=10,
)
