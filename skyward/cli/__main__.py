"""`python -m skyward.cli`: the `skyward` command."""

import sys

from skyward.cli.main import main

sys.exit(main())
