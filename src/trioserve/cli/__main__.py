import sys

from trioserve.cli import command

sys.exit(command())
