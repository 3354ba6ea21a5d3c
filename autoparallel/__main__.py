import sys

from autoparallel.cli import main

sys.exit(main())
