"""`python -m loadtest sweep ...`: see loadtest/sweep.py."""

import sys

from loadtest.sweep import main

sys.exit(main())
