"""The `skyward` command line: its commands, profiles and `skyward run`."""
