"""Pure row work, Arrow in and Arrow out: validation against a pandera schema (``validation``,
with ``precheck`` for provably clean batches), quarantine rows and their JSON values
(``quarantine``), input hashes (``hashing``), isolating the rows a step rejects
(``isolation``), the names of the columns batchinfer writes (``columns``), Arrow types as
pandera and the model see them (``arrow_types``), column profiles and the drift statistics over
them (``column_profiles``, ``drift``) and the comparison of two partitions (``compare``).

No I/O: may import only the core (``errors``, ``imports``); never Beam, never fsspec
(``tests/unit/test_layers.py`` checks both).
"""
