"""The engine: Engine (api.py), its scheduler, sequence state, sampling, the prefix cache, NUMA."""
