"""`python -m jaxkv.cli ...`: the same as the `jaxkv` console script."""

import sys

from jaxkv.cli import main

sys.exit(main())
