"""`python -m pipeserve_operator`: the same as the `pipeserve-operator` console script."""

import sys

from pipeserve_operator.main import main

sys.exit(main())
