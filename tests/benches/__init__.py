"""One module per exercise goal that ``python -m tests.bench N.M`` measures (see tests/bench.py)."""
