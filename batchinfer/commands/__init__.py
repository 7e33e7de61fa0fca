"""What the commands do, one module per command: ``run``, ``backfill``, ``validate`` (and
``plan``), ``profile``, ``inspect`` (and ``track``), ``diff``, ``history``, ``stamp`` and ``schema``; what they
share is the application layer (``app``), the converters of ``export`` are ``convert``; how an
error's remedy is said as a flag or command (``remedies``) is theirs too.

The top layer: may import ``app``, ``convert``, every package below them (``spec``, ``triple``,
``rows``, ``io``, ``handlers``, ``pipeline``) and the core; only ``cli`` and ``demo`` import it.
"""
