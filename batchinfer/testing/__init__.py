"""A conformance kit for model backends, for batchinfer's own and anyone else's (as fsspec's
``fsspec/tests/abstract`` is for filesystems).

The model protocol (handlers/protocol.py: ``load``, ``facts``, ``predict``) checked on a backend
(``check_protocol``), and the backend-independent part of the handler contract
(docs/contract.md §3) as checks that take a backend in its handler (``handler_of``): the batch
contract at 1 row, odd sizes and more rows than a call takes; predictions
against a reference; bit-identical reruns; rows that do not depend on their neighbours, and a
bad (NaN) row that stays in its row; threads that share one model getting what each gets alone
(a backend's ``thread_safe``); calls halved after running out of device memory, losing no
row; reduced precision that keeps the distribution. :class:`BackendConformance` runs them all
as pytest tests: subclass it and give it a :class:`BackendCase`.
tests/conformance/test_backends.py runs the same checks on batchinfer's backends.

The kit is ``conformance``. It imports pytest, so nothing in batchinfer imports it: only a test
suite does. It may import the core and ``handlers``.
"""
from .conformance import (
    SIZES,
    BackendCase,
    BackendConformance,
    check_a_bad_row_stays_in_its_row,
    check_bit_identical_reruns,
    check_distribution,
    check_out_of_memory_loses_no_row,
    check_predictions,
    check_protocol,
    check_rows_do_not_depend_on_their_neighbours,
    check_threads_sharing_a_model,
    handler_of,
    score,
)

__all__ = ["SIZES", "BackendCase", "BackendConformance", "check_a_bad_row_stays_in_its_row",
           "check_bit_identical_reruns",
           "check_distribution", "check_out_of_memory_loses_no_row", "check_predictions",
           "check_protocol", "check_rows_do_not_depend_on_their_neighbours",
           "check_threads_sharing_a_model", "handler_of", "score"]
