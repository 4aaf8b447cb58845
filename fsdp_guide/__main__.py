"""``python -m fsdp_guide``: see :mod:`fsdp_guide.cli`."""

import sys

from fsdp_guide.cli import main

if __name__ == "__main__":
    sys.exit(main())
