"""What the commands do, one module per command (``run``, ``validate``, ``stamp``, ``inspect``,
``backfill``, ``diff``, ``export``) plus ``resolve``, which every command that reads a job
shares.

The top layer: may import every other package (``spec``, ``triple``, ``rows``, ``io``,
``handlers``, ``pipeline``) and the core; only ``cli`` and ``demo`` import it.
"""
