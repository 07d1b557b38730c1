"""Benchmarks behind `hybridinfer bench ...` and bench/*.py: each returns a dict, a markdown table and a plot."""


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), or None without matplotlib (the bench
    extra): a benchmark then writes its table and JSON and says it made no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
