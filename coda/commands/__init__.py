"""The bodies of the ``coda`` command's subcommands; ``coda/cli.py`` declares their options
(the typer app) and binds each body late, so that ``import coda.cli`` stays cheap."""
