import sys

from trioserve.cli import main

sys.exit(main())
