"""A learner's copies of the model, seen from outside its own count: one island's learner runs in
this process against a real `diloco syncer` process, its inner steps emulated
(DILOCO_EMULATE_STEP_SECONDS, learner/emulated_step.py) so that the real sync path runs at a real
size on a CPU, while the main thread walks the process's live CPU tensors every --every seconds
(gc, counted by storage, as FragmentSync.held_copies counts) and names each storage by what
holds it: the weights, the Δ base, the weights at a push, a merged fragment arrived; the rest is
the link's (a push's int8 values and body, a pulled body's decoded copy, a rebuilt fragment not
yet handed over) or the runtime's (the corpus). Per sample also the process's RSS.

Figures in x = one fp32 copy of the model: the peak of the walked tensors with its split, the
learner's own peak (held_copies, "held at most N copies"), and the peak RSS. ARCHITECTURE.md,
"A learner's memory", is the table they are read against. The walk holds the interpreter lock
for a few ms a sample, so the learner runs a little slower than in a job.

    python -m bench.studies.learner_copies                        # gpt-125m, H = 30, 4 rounds
    python -m bench.studies.learner_copies --preset gpt-small --rounds 3
"""

from __future__ import annotations

import gc
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from diloco_trainer.api.contract import LearnerEnv
from diloco_trainer.api.credentials import island_token
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.learner.loop import Learner
from diloco_trainer.local import free_port, start_syncer, wait_ready, write_job_files

from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    install_signal_cleanup,
    publish,
    workdir,
)


def rss_bytes() -> int:
    """This process's resident memory now (/proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def named_storages(learner: Learner) -> dict[int, str]:
    """Storage address -> what of the learner holds it (FragmentSync.held_copies' groups)."""
    names: dict[int, str] = {}

    def name(group: str, tensors: Any) -> None:
        for t in tensors:
            names.setdefault(t.untyped_storage().data_ptr(), group)

    name("weights", learner.params.values())
    sync = learner.sync
    if sync is not None:
        for s in list(sync.fragments):
            name("base", list(s.base.values()))
            name("at_push", list((s.at_push or {}).values()))
            name("last_update", list((s.last_update or {}).values()))
        for r in list(sync.arrived.values()):
            name("arrived", list(r.pulled.tensors.values()))
        if sync.error_feedback is not None:
            name("residuals", list(sync.error_feedback.residuals.values()))
    return names


def live_tensors(learner: Learner) -> Counter[str]:
    """Bytes of the process's live CPU tensors by storage, grouped by named_storages; the rest
    'link or runtime'."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
    return attributed(storages, named_storages(learner))


def attributed(storages: dict[int, int], names: dict[int, str]) -> Counter[str]:
    """Bytes by name of storages (address -> bytes), each byte once: a storage that lies inside
    another (torch.frombuffer's tensors inside the buffer of a decoded body, which that buffer's
    own tensor keeps alive) is counted under its own name when it has one and is left out of
    the buffer's; inside nothing, under its name or 'link or runtime'. (A learner's base made
    from a pulled body is such a view: counted as the body too, it read 1x more than there
    was.)"""
    out: Counter[str] = Counter()
    items = sorted(storages.items())
    i = 0
    while i < len(items):
        ptr, nbytes = items[i]
        end = ptr + nbytes
        named_inside = 0
        j = i + 1
        while j < len(items) and items[j][0] < end:
            inner, inner_bytes = items[j]
            if inner in names:
                part = min(inner_bytes, end - inner)
                out[names[inner]] += part
                named_inside += part
            j += 1
        out[names.get(ptr, "link or runtime")] += nbytes - named_inside
        i = j
    return out


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt-125m")
    p.add_argument("--inner-steps", type=int, default=30, help="H")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=100.0, help="an emulated step's wall time")
    p.add_argument("--every", type=float, default=0.15, help="seconds between two walks")
    args = p.parse_args(argv)
    install_signal_cleanup()
    load = LoadMonitor()
    seq_len = 128
    spec = parse_spec(
        {
            "model": {"preset": args.preset, "seed": 0},
            "data": {"source": "builtin:stdlib-text", "evalTokens": 1024, "seed": 0},
            "islands": {"count": 1},
            "inner": {"steps": args.inner_steps, "batchSize": 1, "seqLen": seq_len},
            "stopAfter": {"tokens": args.rounds * args.inner_steps * seq_len},
            "syncer": {"evalEveryOuterSteps": 100000, "checkpoint": {"everyOuterSteps": 100000}},
        }
    )
    torch.set_num_threads(1)
    with load, workdir(args.workdir, "learner-copies") as wd:
        files = write_job_files(spec, wd / "job")
        port = free_port()
        syncer = start_syncer(
            files,
            port=port,
            state_dir=wd / "state",
            job_name="copies",
            log_file=wd / "syncer.log",
            extra_env={"OMP_NUM_THREADS": "1"},
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, files.token, timeout=600, proc=syncer)
            env = LearnerEnv(
                job_name="copies",
                island="island-0",
                island_index=0,
                rank=0,
                world_size=1,
                master_addr="127.0.0.1",
                master_port=1,
                syncer_url=url,
                token=island_token(files.token, "island-0"),
                config_file=files.config_file,
                ca_file=None,
                device="cpu",
                slowdown=1.0,
                emulate_step=args.step_ms / 1000,
            )
            learner = Learner(spec, env, "cpu", threading.Event())
            copy = 4 * sum(p.numel() for p in learner.params.values())
            code: dict[str, int] = {}
            runner = threading.Thread(target=lambda: code.setdefault("rc", learner.run()))
            runner.start()
            peak: Counter[str] = Counter()
            peak_rss = 0
            while runner.is_alive():
                now = live_tensors(learner)
                if sum(now.values()) > sum(peak.values()):
                    peak = now
                peak_rss = max(peak_rss, rss_bytes())
                time.sleep(args.every)
            runner.join()
        finally:
            syncer.stop(timeout=5)
    own = learner.sync.peak_copies if learner.sync is not None else {}
    table = Table(
        f"{args.preset} (x = {copy / 2**30:.2f} GiB), one island, H = {args.inner_steps}, "
        f"{args.rounds} rounds, {args.step_ms:.0f} ms steps; exit code {code.get('rc')}",
        ["measure", "x", "split (x)"],
    )
    table.add(
        "live CPU tensors, peak",
        f"{sum(peak.values()) / copy:.2f}",
        ", ".join(f"{k} {v / copy:.2f}" for k, v in peak.most_common()),
    )
    table.add(
        "the learner's own count (held_copies), peak",
        f"{sum(own.values()) / copy:.2f}",
        ", ".join(f"{k} {v / copy:.2f}" for k, v in own.items() if v),
    )
    table.add("RSS, peak", f"{peak_rss / copy:.2f}", "with torch and the corpus")
    report = Report(
        script="learner_copies",
        summary="A learner's copies of the model: its own count against its live tensors",
        tables=[table],
        notes=["ARCHITECTURE.md, 'A learner's memory', is the table these are read against."],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
