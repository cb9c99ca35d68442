"""Entry point of the node agent: ``python -m skyward.worker``."""

from skyward.worker.agent import main

if __name__ == "__main__":
    main()
