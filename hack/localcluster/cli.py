"""Run a real Kubernetes control plane on loopback, with kwok fake nodes.

Components (all built from pinned sources by hack/build-binaries.sh): etcd,
kube-apiserver (RBAC), kube-controller-manager, kube-scheduler and kwok, which
plays the kubelet for a few fake nodes so that pods get scheduled and become
Running and Ready without containers.

Usage:
  hack/local-cluster up     [--dir DIR] [--nodes N] [--apiserver-port P] [--etcd-port P]
                            [--owner-pid PID] [--name NAME] [--attempts 3] [--timeout 900]
                            [--real-node]
  hack/local-cluster load-image ARCHIVE.tar [--dir DIR]   (OCI/docker archive -> the real node)
  hack/local-cluster down   [--dir DIR] [--keep-logs]
  hack/local-cluster status [--dir DIR]
  hack/local-cluster kubeconfig-for-sa NAMESPACE SERVICEACCOUNT [--dir DIR] [--duration 24h]

`up` prints `export KUBECONFIG=DIR/kubeconfig` as its last line on stdout, so
`eval "$(hack/local-cluster up)"` points kubectl at the new cluster. Progress and
errors go to stderr. A failed start is retried (new ports, new data) up to --attempts times.
The default DIR is ${TMPDIR:-/tmp}/diloco-local-cluster. Use a
different --dir per cluster to run several side by side (ports are picked at random
unless given).

--real-node adds one real node (containerd + runc, kubelet, kube-proxy, CoreDNS; root only,
one per machine), named real-node-0 and tainted diloco.dev/real-node=true:NoSchedule.

Environment:
  DILOCO_NODE_BIN_DIR     the real node's binaries from this directory (hack/build-node.sh)
  DILOCO_K8S_BIN_DIR      use binaries from this directory instead of building them
  DILOCO_K8S_CACHE        cache root used by hack/build-binaries.sh
  DILOCO_K8S_PORT_LEASES  port lease file (default /tmp/diloco-local-cluster-ports.json)
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from pathlib import Path

from .components import https_ok
from .errors import ClusterError, info
from .objects import node_ready
from .pki import kubeconfig_yaml
from .processes import run
from .settings import COMPONENTS, NODE_COMPONENTS, UP_ATTEMPTS, UP_TIMEOUT, default_dir
from .shutdown import stop_cluster, wipe
from .state import Cluster
from .up import cmd_up, cmd_watchdog


def cmd_down(args: argparse.Namespace) -> int:
    c = Cluster(Path(args.dir))
    if not c.dir.exists():
        info(f"nothing to do: {c.dir} does not exist")
        return 0
    lock_fd = c.lock()
    try:
        if c.load():
            stop_cluster(c)
        elif not (c.dir / "pki").exists() and not (c.dir / "etcd").exists():
            info(f"{c.dir} holds no local-cluster state; leaving it alone")
            return 0
        wipe(c, keep_logs=args.keep_logs)
    finally:
        os.close(lock_fd)
    info(f"cluster in {c.dir} stopped" + (" (logs kept)" if args.keep_logs else " and removed"))
    return 0


def print_processes(c: Cluster) -> bool:
    """One line per recorded process; True if every component runs."""
    healthy = True
    node = list(NODE_COMPONENTS) if c.state.get("real_node") else []
    for name in [*COMPONENTS, *node, "watchdog"]:
        p = c.processes().get(name)
        if not p:
            if name != "watchdog":
                print(f"  {name:25s} not started")
                healthy = False
            continue
        alive = c.running(name)
        healthy &= alive
        print(f"  {name:25s} pid {p['pid']:<8d} {'running' if alive else 'DEAD'}")
    return healthy


def cmd_status(args: argparse.Namespace) -> int:
    c = Cluster(Path(args.dir))
    if not c.load():
        print(f"no cluster in {c.dir}")
        return 1
    print(f"cluster:    {c.state.get('name')}  ({c.dir})")
    print(f"apiserver:  {c.server}")
    print(f"kubeconfig: {c.kubeconfig}")
    print(f"binaries:   {c.state.get('bin_dir')}")
    healthy = print_processes(c)
    try:
        ready = https_ok(c.server + "/readyz", c.ssl_context())
    except (OSError, ssl.SSLError):
        ready = False
    print(f"  apiserver /readyz: {'ok' if ready else 'FAILING'}")
    if ready:
        try:
            nodes = c.api("GET", "/api/v1/nodes")["items"]
            n_ready = sum(node_ready(n) for n in nodes)
            print(f"  nodes: {n_ready}/{len(nodes)} Ready")
        except (OSError, ValueError, KeyError) as e:
            print(f"  nodes: cannot list ({e})")
    return 0 if healthy and ready else 1


def cmd_kubeconfig_for_sa(args: argparse.Namespace) -> int:
    c = Cluster(Path(args.dir))
    if not c.load():
        raise ClusterError(
            f"no cluster in {c.dir}; run `hack/local-cluster up --dir {c.dir}` first"
        )
    kubectl = str(Path(c.state["bin_dir"]) / "kubectl")
    proc = run(
        [
            kubectl,
            f"--kubeconfig={c.kubeconfig}",
            "create",
            "token",
            args.serviceaccount,
            "-n",
            args.namespace,
            f"--duration={args.duration}",
        ]
    )
    token = proc.stdout.strip()
    if not token:
        raise ClusterError("kubectl create token returned an empty token")
    user = f"system:serviceaccount:{args.namespace}:{args.serviceaccount}"
    sys.stdout.write(
        kubeconfig_yaml(
            c.state["name"], c.server, c.pki / "ca.crt", user, token=token, namespace=args.namespace
        )
    )
    return 0


def cmd_load_image(args: argparse.Namespace) -> int:
    """Import an image archive into the real node's containerd (there is no registry)."""
    from .nodeconfig import NodePaths
    from .realnode import import_image

    c = Cluster(Path(args.dir))
    if not c.load() or not c.state.get("real_node") or not c.running("containerd"):
        raise ClusterError(f"no running real node in {c.dir}; run `up --real-node --dir {c.dir}`")
    archive = Path(args.archive)
    if not archive.is_file():
        raise ClusterError(f"no such file: {archive}")
    out = import_image(NodePaths(c.dir / "node"), Path(c.state["real_node"]["bin_dir"]), archive)
    info(f"imported into the real node: {out}")
    return 0


def add_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir", default=str(default_dir()), help="state directory (default: %(default)s)"
    )


def add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = sub.add_parser("up", help="start the control plane (builds binaries on first use)")
    add_dir(up)
    up.add_argument(
        "--name", help="cluster/context name in the kubeconfig (default: diloco-<dir name>)"
    )
    up.add_argument("--nodes", type=int, default=4, help="number of kwok fake nodes (default: 4)")
    up.add_argument(
        "--apiserver-port", type=int, default=0, help="kube-apiserver port (default: random)"
    )
    up.add_argument("--etcd-port", type=int, default=0, help="etcd client port (default: random)")
    up.add_argument(
        "--attempts",
        type=int,
        default=UP_ATTEMPTS,
        help="tries at starting the cluster, each with new ports and data (default: %(default)s)",
    )
    up.add_argument(
        "--timeout",
        type=float,
        default=UP_TIMEOUT,
        help="seconds for the whole of `up`, all attempts (default: %(default)s)",
    )
    up.add_argument(
        "--owner-pid",
        type=int,
        default=0,
        help="tear the cluster down automatically when this process exits",
    )
    up.add_argument(
        "--real-node",
        action="store_true",
        help="also start one real node (containerd, kubelet, kube-proxy, CoreDNS; needs root)",
    )
    up.set_defaults(func=cmd_up)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="local-cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_up_parser(sub)

    down = sub.add_parser("down", help="stop the control plane and remove its state")
    add_dir(down)
    down.add_argument("--keep-logs", action="store_true", help="keep DIR/logs")
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="show the components and their health")
    add_dir(status)
    status.set_defaults(func=cmd_status)

    load = sub.add_parser("load-image", help="import an image archive into the real node")
    add_dir(load)
    load.add_argument("archive", help="an OCI (or docker-save) image archive, .tar")
    load.set_defaults(func=cmd_load_image)

    sa = sub.add_parser(
        "kubeconfig-for-sa", help="print a kubeconfig that authenticates as a ServiceAccount"
    )
    add_dir(sa)
    sa.add_argument("namespace")
    sa.add_argument("serviceaccount")
    sa.add_argument("--duration", default="24h", help="token lifetime (default: %(default)s)")
    sa.set_defaults(func=cmd_kubeconfig_for_sa)

    wd = sub.add_parser("_watchdog")
    add_dir(wd)
    wd.add_argument("--owner-pid", type=int, required=True)
    wd.add_argument("--owner-start", type=int, default=0, help="its start time (0: unknown)")
    wd.add_argument("--processes", default="{}", help="JSON {name: {pid, exe}}")
    wd.set_defaults(func=cmd_watchdog)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "nodes", 1) < 1:
        parser.error("--nodes must be at least 1")
    if getattr(args, "attempts", 1) < 1:
        parser.error("--attempts must be at least 1")
    try:
        return args.func(args)
    except ClusterError as e:
        info(f"ERROR: {e}")
        return 1
    except KeyboardInterrupt:
        info("interrupted")
        return 130
