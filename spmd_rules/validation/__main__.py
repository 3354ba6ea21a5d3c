"""``python -m spmd_rules.validation --all``: check every spmd rule (see the package docstring)."""
import sys

from .driver import main

sys.exit(main())
