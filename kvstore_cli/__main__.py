"""``python -m kvstore_cli ...``: the ``kvstore`` command without the installed script."""

import sys

from kvstore_cli.main import main

sys.exit(main())
