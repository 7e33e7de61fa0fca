"""I/O at the edges: listing and reading shards (``shards``), whether an output is inside the
input's reach (``reach``), writing output files (``outputs``), the typed records of a partition
(``records``), the manifest (``manifest``) and the commit protocol over it (``commit``),
MLflow (``tracking``), and fsspec URLs (``storage``).

May import only the core (``errors``, ``faults``, ``redaction``).
"""
