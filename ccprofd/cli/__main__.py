"""``python -m ccprofd.cli``: the ``ccprofd`` command."""

import sys

from ccprofd.cli.main import main

sys.exit(main())
