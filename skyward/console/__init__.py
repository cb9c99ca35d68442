"""What the user sees of a pool: the console, the live region, notebooks, progress."""
