"""``python -m coda`` runs the ``coda`` command (the same typer app as the console script)."""

from coda.cli import main

if __name__ == "__main__":
    main()
