"""The Local provider as the registry knows it: no extra, no command-line options."""

from skyward.providers.registry import ProviderEntry

ENTRY = ProviderEntry("local", "skyward.providers.local.provider", "Local", position=0)
