"""`python -m onepath ...` (and `torchrun --nproc-per-node N -m onepath train ...`): the command line."""
import sys

from onepath.cli import main

sys.exit(main())
