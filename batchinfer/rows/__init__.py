"""Pure row work, Arrow in and Arrow out: validation against a pandera schema (``validation``,
with ``precheck`` for provably clean batches), quarantine rows and their JSON values
(``quarantine``), input hashes (``hashing``), isolating the rows a step rejects
(``isolation``), and the names of the columns batchinfer writes (``columns``).

No I/O: may import only the core (``errors``, ``imports``); never Beam, never fsspec
(``tests/unit/test_layers.py`` checks both).
"""
