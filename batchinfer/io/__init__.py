"""I/O at the edges: listing and reading shards (``shards``), whether an output is inside the
input's reach (``reach``), writing output files (``outputs``), the typed records of a partition
(``records``, made from and to JSON by the core's ``codec`` and validated where read by
``readback``), the
manifest (``manifest``) and the commit protocol over it (``commit``), adopting a crashed
attempt's shards (``resume``) and updating a partition whose shards changed (``update``), the
table formats (``formats``: the registry; ``sinks``: where a commit writes; ``delta_tables``,
``iceberg_tables``; ``tables_in``: what every table input shares), reading a committed
partition whatever its format (``partitions``), MLflow (``tracking``), OpenLineage events
(``lineage``), and fsspec URLs (``storage``).

May import only the core (``errors``, ``faults``, ``redaction``, ``codec``, ``profile_records``).
"""
