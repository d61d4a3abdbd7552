"""The paper experiments, run from the repository root as modules: ``python -m experiments.table1_capacity``."""
