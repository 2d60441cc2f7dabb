import sys

from lp_jax.inspect.cli import main

sys.exit(main())
