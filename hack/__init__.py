"""The test ground's tools as a package, so that the tests and bench/ import
`hack.localcluster.harness` from the repository root and `lint-imports` checks hack/'s contracts
(pyproject.toml). `hack/local-cluster` puts hack/ itself on sys.path and imports `localcluster`
from there, so nothing here runs for it."""
