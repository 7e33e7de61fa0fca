"""The suite's shared fixtures: the real servers (servers.py) and the helpers of factories.py.

``tests/`` is on ``sys.path`` through pytest's ``pythonpath`` setting (pyproject.toml), so
test modules in every folder import ``factories``, ``servers`` and ``forkserver`` by name;
``outcomes`` records what each test of the session came to.
"""
pytest_plugins = ["servers", "factories", "outcomes"]
