"""Studies: one-off investigations behind a figure in bench/log/, kept runnable:
`python -m bench.studies.NAME`."""
