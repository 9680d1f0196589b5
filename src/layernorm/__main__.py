"""``python -m layernorm``: the same as the ``layernorm`` command."""

import sys

from .cli import main

sys.exit(main())
