"""The commands of the command line, one module per command, named as the command: ``run``,
``backfill``, ``profile``, ``report``, ``history``, ``validate``, ``plan``, ``inspect``, ``diff``, ``export``,
``stamp``, ``schema``, ``track``, ``demo``. Each declares its ``HELP`` line and its arguments
(``add_arguments``), and ``execute(args)`` returns a typed result that renders itself
(:class:`results.Result`); the work is in ``commands``, ``app``, ``convert`` and ``demo``, imported
when the command executes, so that parsing stays light. Shared: ``arguments`` (the job spec,
``--ds``, ``--set``) and ``results`` (the result type, lines more than one command prints).

May import ``commands``, ``app``, ``convert``, ``demo``, every package below them and the core;
only ``cli`` imports it.
"""
