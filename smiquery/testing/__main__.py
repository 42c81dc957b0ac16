"""``python -m smiquery.testing``: run the fake ``nvidia-smi`` with nvidia-smi's own arguments."""

import sys

from smiquery.testing import main

sys.exit(main())
