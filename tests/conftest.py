"""The suite's shared fixtures: the real servers (servers.py) and the helpers of factories.py.

``tests/`` is on ``sys.path`` through pytest's ``pythonpath`` setting (pyproject.toml), so
test modules in every folder import ``factories``, ``servers`` and ``forkserver`` by name.
"""
pytest_plugins = ["servers", "factories"]
