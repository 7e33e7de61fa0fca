"""The suite's shared fixtures: the real servers (servers.py) and the helpers of factories.py.

``tests/`` is on ``sys.path`` through pytest's ``pythonpath`` setting (pyproject.toml), so
test modules in every folder import ``factories``, ``servers`` and ``forkserver`` by name;
``outcomes`` records what each test of the session came to.
"""
import os
import sys
from collections import Counter
from pathlib import Path

import artefacts
import pytest


def _keep_bytecode() -> None:
    """With ``PYTHONDONTWRITEBYTECODE`` set (this machine's environment sets it), every run
    compiles the project anew in each process and pytest rewrites every test module's asserts
    again: 14.8 s instead of 8.3 s to collect the dev loop, 66 s instead of 50 s for all of it.
    The variable's point is no ``__pycache__`` beside the sources, so the suite keeps its
    bytecode in the test cache instead (``sys.pycache_prefix``, which pytest's rewrite cache
    honours), for itself and, through the environment, for every process it starts."""
    if not sys.dont_write_bytecode:
        return
    prefix = str(artefacts.root() / "pycache")
    sys.pycache_prefix, sys.dont_write_bytecode = prefix, False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = prefix


_keep_bytecode()

pytest_plugins = ["servers", "factories", "outcomes"]

# The modules that take longest (seconds of a whole `pytest -n 2 --durations=0` run, summed per
# module), run first: with ``-n 2 --dist loadscope`` each module goes to one worker, in collection
# order (``--no-loadscope-reorder`` in pyproject.toml: xdist otherwise reorders the modules by their
# number of tests, which sent the one-test gpu_check module, 33 s, to the very end and left the other
# worker idle meanwhile), so a long module collected last would leave one worker alone at the end.
# Only the modules' order changes; each module's own order is kept (test_backends.py's last test
# reads what the ones before ran).
LONGEST_FIRST = [
    "e2e/test_airflow.py", "with_servers/test_distributed_runners.py", "with_servers/test_tracking.py",
    "with_servers/test_s3.py", "with_servers/test_isolated_workers.py", "e2e/test_e2e_explain.py",
    "e2e/test_text_embeddings.py", "with_servers/test_model_store.py", "faults/test_crash.py",
    "conformance/test_gpu_check.py", "e2e/test_monitoring.py", "e2e/test_quantize.py",
    "e2e/test_hardening.py", "e2e/test_e2e_delta.py", "faults/test_concurrency.py",
    "e2e/test_e2e_challengers.py", "faults/test_table_races.py", "e2e/test_tables_replace.py",
    "e2e/test_hardening_3.py", "with_servers/test_secrets.py", "e2e/test_backfill_diff.py",
    "unit/test_property.py", "conformance/test_backends.py", "with_servers/test_iceberg_s3.py",
    "faults/test_update_faults.py", "faults/test_interrupt.py", "e2e/test_e2e_token_batches.py",
    "unit/test_registries.py", "unit/test_validation.py", "conformance/test_unavailable.py",
    "e2e/test_lineage.py", "e2e/test_e2e_errors.py", "e2e/test_triple_code.py", "with_servers/test_tracking_batches.py",
]

# Modules that use the session's `mlflow server` (servers.mlflow_live) go to one worker, as one
# work unit: each worker that runs one of them starts its own server, about 12 s of CPU (the
# server, its uvicorn worker).
ONE_WORKER = {module: "mlflow_live" for module in (
    "with_servers/test_tracking.py", "with_servers/test_model_store.py", "with_servers/test_secrets.py",
    "with_servers/test_tracking_batches.py", "with_servers/test_registry.py")}


@pytest.hookimpl(optionalhook=True)   # an xdist hook: a session without xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope``, with the modules of each :data:`ONE_WORKER` group in one scope
    (queued where its first module comes in the collection order)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].removeprefix("tests/")
            return ONE_WORKER.get(module) or super()._split_scope(nodeid)

    return Scheduling(config, log)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests = Path(__file__).parent
    per_module = Counter(item.path for item in items)

    def module_rank(item) -> tuple[int, int]:
        # The modules not listed follow, those with most tests first (what xdist's reordering
        # did, and a fair guess at their length: the dev loop, `-m "not slow"`, is mostly those).
        listed = item.path.is_relative_to(tests) and item.path.relative_to(tests).as_posix()
        return rank.get(listed, len(rank)), -per_module[item.path]

    items.sort(key=module_rank)   # stable: the order within a module is kept
