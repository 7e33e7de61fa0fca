"""The suite's shared fixtures: the real servers (servers.py) and the helpers of factories.py.

``tests/`` is on ``sys.path`` through pytest's ``pythonpath`` setting (pyproject.toml), so
test modules in every folder import ``factories``, ``servers`` and ``forkserver`` by name;
``outcomes`` records what each test of the session came to.
"""
from pathlib import Path

pytest_plugins = ["servers", "factories", "outcomes"]

# The modules that take longest (seconds of a whole run, measured with --junitxml), run first:
# with ``-n 2 --dist loadscope`` each module goes to one worker, in collection order, so a long
# module collected last would leave one worker alone at the end. Only the modules' order changes;
# each module's own order is kept (test_backends.py's last test reads what the ones before ran).
LONGEST_FIRST = [
    "with_servers/test_distributed_runners.py", "with_servers/test_isolated_workers.py",
    "faults/test_crash.py", "with_servers/test_tracking.py",
    "e2e/test_airflow.py", "e2e/test_e2e_explain.py", "with_servers/test_s3.py",
    "conformance/test_gpu_check.py",
    "faults/test_concurrency.py", "e2e/test_text_embeddings.py", "conformance/test_backends.py",
    "with_servers/test_secrets.py", "with_servers/test_model_store.py", "e2e/test_hardening.py",
    "e2e/test_monitoring.py",
]


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests = Path(__file__).parent

    def module_rank(item) -> int:
        if not item.path.is_relative_to(tests):
            return len(rank)
        return rank.get(item.path.relative_to(tests).as_posix(), len(rank))

    items.sort(key=module_rank)   # stable: the order within a module, and of the rest, is kept
