"""``python -m fastdraft.cli``: the ``fastdraft`` command."""

import sys

from fastdraft.cli.commands import main

sys.exit(main())
