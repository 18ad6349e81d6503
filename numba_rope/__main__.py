import sys

from numba_rope._cli import main

sys.exit(main())
