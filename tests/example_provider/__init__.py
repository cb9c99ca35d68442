"""A provider that lives outside skyward: the registry's test (`tests/test_registry.py`)."""
