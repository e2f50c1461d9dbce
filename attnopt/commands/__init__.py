"""Subcommands of the ``attnopt`` CLI, one module each."""
