"""`python -m kdjax.smollm2`: see kdjax/smollm2/prepare.py."""
import sys

from kdjax.smollm2 import prepare

sys.exit(prepare.main())
