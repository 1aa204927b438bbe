"""One torchft replica group running DiLoCo (torchft 0.2.0): `-m bench.harness.torchft_worker`.

This is the peer we measure against, used as torchft's own examples use it: a Manager with a
ProcessGroupGloo talks to a lighthouse, and `torchft.local_sgd.DiLoCo` hooks the pseudo-gradient
all-reduce and the outer step into the inner optimizer's `step()`. The model, data shard, inner
AdamW and schedule, and outer Nesterov SGD are ours (bench.harness.peer_training), so only the
synchronisation differs. One process = one replica group of one rank.

Instrumentation, none of which changes what torchft does:
- the bytes of every tensor handed to `Manager.allreduce` are counted (payload per worker);
- a step post-hook registered before DiLoCo's marks the end of the AdamW update, so the time
  DiLoCo's own hook then spends syncing is measured apart from compute;
- a round's tokens count as *useful* when its sync committed and this replica trained it itself
  (not when it was healed from a peer in that round: then it sent a copy of the peer's work).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from diloco_trainer.api.spec import load_spec
from diloco_trainer.models.parts import build_parts, evaluate, make_inner_optimizer
from safetensors.torch import save_model
from torch.distributed import TCPStore
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from bench.harness.common import ring_allreduce_bytes
from bench.harness.peer_training import (
    Progress,
    ProgressLog,
    Throttle,
    build_outer_optimizer,
    forward_backward,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--spec", type=Path, required=True, help="job spec (JSON or YAML)")
    p.add_argument("--replica", type=int, required=True, help="replica index = data shard")
    p.add_argument("--num-shards", type=int, required=True, help="data shards (M)")
    p.add_argument("--lighthouse", required=True, help="lighthouse URL, http://127.0.0.1:PORT")
    p.add_argument("--min-replicas", type=int, required=True, help="Manager min_replica_size")
    p.add_argument("--outer-steps", type=int, default=0, help="stop after this many commits")
    p.add_argument("--max-seconds", type=float, default=0, help="stop after this long (0: no)")
    p.add_argument("--slowdown", type=float, default=1.0, help="straggler factor (>= 1)")
    p.add_argument(
        "--sync-delay", type=int, default=0, help="DiLoCo fragment_sync_delay (overlap steps)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="collective/commit timeout (s)")
    p.add_argument("--progress", type=Path, default=None, help="JSON-lines progress file")
    p.add_argument("--out", type=Path, default=None, help="JSON result (with --eval)")
    p.add_argument("--eval", action="store_true", help="evaluate the final weights")
    p.add_argument(
        "--save-dir",
        type=Path,
        default=None,
        help="save the global weights after every commit (safetensors), for evaluation later",
    )
    return p.parse_args()


def save_global(directory: Path, model: torch.nn.Module, outer_step: int) -> None:
    """Write the weights just committed (DiLoCo left the model at the global weights) and log when.

    The index line is written after the file, so every indexed file is complete.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"outer-{outer_step}.safetensors"
    save_model(model, str(path))
    with (directory / "index.jsonl").open("a") as f:
        f.write(json.dumps({"outer_step": outer_step, "time": time.time(), "file": path.name}))
        f.write("\n")


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    spec = load_spec(args.spec)
    H = spec.inner.steps
    parts = build_parts(spec, shard_index=args.replica, num_shards=args.num_shards)
    model = parts.model
    inner = make_inner_optimizer(spec, model)
    outer = build_outer_optimizer(spec, model)
    healed = {"round": False}

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])
        healed["round"] = True

    timeout = timedelta(seconds=args.timeout)
    # The replica group's own store (torchrun would start it): the Manager connects as a client.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        use_async_quorum=False,  # DiLoCo requires it
        replica_id=f"replica_{args.replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
        init_sync=False,  # every replica builds identical initial weights from spec.model.seed
        timeout=timeout,
        quorum_timeout=timedelta(seconds=max(600.0, args.timeout)),
        connect_timeout=timedelta(seconds=30),
    )
    payload = {"bytes": 0, "world": 1}
    plain_allreduce = manager.allreduce

    def counting_allreduce(tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
        payload["bytes"] += tensor.numel() * tensor.element_size()
        payload["world"] = max(payload["world"], manager.num_participants())
        return plain_allreduce(tensor, *a, **kw)

    manager.allreduce = counting_allreduce  # type: ignore[method-assign]

    marks = {"updated": 0.0}
    inner.register_step_post_hook(lambda *_: marks.__setitem__("updated", time.perf_counter()))

    throttle = Throttle(args.slowdown)
    progress = Progress(worker=f"replica_{args.replica}", started=time.time())
    log = ProgressLog(args.progress)
    deadline = time.monotonic() + args.max_seconds if args.max_seconds > 0 else float("inf")
    round_tokens = 0
    local = 0
    with DiLoCo(manager, [model], inner, outer, sync_every=H, fragment_sync_delay=args.sync_delay):
        while time.monotonic() < deadline and not (
            args.outer_steps and manager.current_step() >= args.outer_steps
        ):
            t0 = time.perf_counter()
            step = manager.current_step() * H + local
            progress.loss, n = forward_backward(spec, parts, model, inner, step)
            throttle.after(time.perf_counter() - t0)
            before = manager.current_step()
            inner.step()
            t_end = time.perf_counter()
            progress.compute_seconds += marks["updated"] - t0
            progress.sync_seconds += t_end - marks["updated"]
            progress.steps += 1
            progress.tokens += n
            round_tokens += n
            local += 1
            if local == H:  # DiLoCo synced (or tried to) inside step()
                if manager.current_step() > before:
                    progress.commits += 1
                    if not healed["round"]:
                        progress.useful_tokens += round_tokens
                    if args.save_dir is not None:
                        save_global(args.save_dir, model, manager.current_step())
                round_tokens, local, healed["round"] = 0, 0, False
                log.write(progress, force=True)
            else:
                log.write(progress)
    log.write(progress, force=True)

    if args.out is not None:
        result = {
            "replica": args.replica,
            "outer_steps": manager.current_step(),
            "steps": progress.steps,
            "tokens": progress.tokens,
            "useful_tokens": progress.useful_tokens,
            "payload_bytes": payload["bytes"],
            "bytes_per_worker": ring_allreduce_bytes(payload["bytes"], payload["world"]),
            "compute_seconds": progress.compute_seconds,
            "sync_seconds": progress.sync_seconds,
            "wall_seconds": time.time() - progress.started,
            "train_loss": progress.loss,
            "eval_loss": evaluate(parts, model) if args.eval else None,
        }
        args.out.write_text(json.dumps(result))
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
