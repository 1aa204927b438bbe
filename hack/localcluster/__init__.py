"""hack/local-cluster as a package: a real Kubernetes control plane on loopback with kwok nodes.

Modules (stdlib only, like the `hack/local-cluster` entry point that runs `cli.main`):

- `settings`: paths, component names, CIDRs and the deadline of every wait
- `errors`: ClusterError, progress lines on stderr, log tails
- `processes`: commands, polling, pid identity (pid + start time), signals
- `ports`: free loopback ports outside the ephemeral range, leased machine-wide
- `state`: one cluster directory (state.json, pids, logs, lock) and its processes
- `pki`: certificates (openssl) and kubeconfigs
- `components`: the binaries and each component's arguments, started in order
- `nodes`: the kwok fake nodes and the readiness of the cluster
- `up`: `up` with its retries, and the owner watchdog
- `cli`: the command line (`up`, `down`, `status`, `kubeconfig-for-sa`)

`harness` is the one module that is not stdlib-only: what tests/cluster and bench share (a
started control plane, kubectl, the operator as a process, readiness checks, polling). The
command line never imports it.
"""
