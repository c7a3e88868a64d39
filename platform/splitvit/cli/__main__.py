"""``python -m splitvit.cli``: the ``splitvit`` command."""

import sys

from .app import main

if __name__ == "__main__":  # importing the module (as tests that import every module do) runs nothing
    sys.exit(main())
