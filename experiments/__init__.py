"""Benchmarks, studies and archived A/B runs; each runs as a module from the repository root:
`python -m experiments.FOLDER.NAME` (experiments/README.md)."""
