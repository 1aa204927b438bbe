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
- `objects`: readiness of nodes and pods from their conditions
- `realnode`, `nodeconfig`, `nodeteardown`, `mounts`, `ociimage`: the real node of
  `up --real-node` (start, config files, teardown, mounts, local OCI images)
- `shutdown`: stopping a whole cluster (the real node first) and removing its directory
- `up`: `up` with its retries, and the owner watchdog
- `cli`: the command line (`up`, `down`, `status`, `load-image`, `kubeconfig-for-sa`)

Imports go one way (cli -> up -> shutdown/nodes -> nodeteardown -> realnode -> components ->
state -> the rest); `lint-imports` fails on a cycle. `harness` (with `operator_process` and
`polling`) is what tests/cluster and bench share (a started control plane, kubectl, the
operator as a process, readiness checks, polling): torch-free, but it starts the operator with
`diloco_trainer.local`, so it is not stdlib-only, and the command line never imports it (both
checked by `lint-imports`, pyproject.toml).
"""
