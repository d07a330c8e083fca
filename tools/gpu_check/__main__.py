"""``python -m gpu_check`` (tools/ on PYTHONPATH): see ``gpu_check.cli``."""

import sys

from gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
