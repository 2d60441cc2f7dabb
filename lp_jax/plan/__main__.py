import sys

from lp_jax.plan.cli import main

sys.exit(main())
