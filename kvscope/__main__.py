"""`python -m kvscope`: the same command line as the `kvscope` script, for an environment without the script."""

from kvscope.cli import app

app(prog_name="kvscope")
