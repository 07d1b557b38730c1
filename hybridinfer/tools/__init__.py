"""Tools in the package: synthetic models and the `hybridinfer bench` benchmarks."""
