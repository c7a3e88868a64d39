"""The ``splitvit`` command.

Each subcommand parses its arguments, calls the library, prints its figures and,
with ``--json PATH``, writes them as JSON for scripts: one envelope for every
command (:func:`.output.envelope`), written on failure too. Every subcommand takes
``-v`` and ``--tracking-uri`` (:func:`.options.common_options`); those that take
config overrides take them as ``--set KEY=VALUE``.

:mod:`.app` builds the parser and runs a command; :mod:`.output` and :mod:`.options`
hold what the subcommands share; each subcommand has its module (``add_parser``
adds its parser, ``run`` runs it), which imports the library (torch, Ray, MLflow)
only when it runs, so ``splitvit --help`` and a usage error stay fast.
"""

from .app import main

__all__ = ["main"]
