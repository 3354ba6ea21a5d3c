"""Kept for the commands quoted in docs: the rule validator is ``python -m spmd_rules.validation``."""
from spmd_rules.validation.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
