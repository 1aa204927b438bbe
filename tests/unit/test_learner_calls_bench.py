"""bench/studies/learner_calls names the learner's methods it times: each must still exist, or the
benchmark would fail in the learner's process at start-up. Its timers count the calls of one
thread only, with the calls they make inside them."""

from __future__ import annotations

import importlib
import itertools
import threading

from bench.studies import learner_calls


def test_every_timed_method_exists_and_the_rows_nest_under_their_caller() -> None:
    for depth, module, owner, method in learner_calls.TARGETS:
        assert callable(getattr(getattr(importlib.import_module(module), owner), method)), method
        assert depth >= 0
    depths = [d for d, *_ in learner_calls.TARGETS]
    assert depths[0] == 0
    assert all(b <= a + 1 for a, b in itertools.pairwise(depths))
    assert learner_calls.STEP in {f"{o}.{m}" for _, _, o, m in learner_calls.TARGETS}


def test_the_timers_count_the_chosen_threads_calls_only() -> None:
    class Work:
        def outer(self) -> int:
            return self.inner() + 1

        def inner(self) -> int:
            return 1

    timers = learner_calls.CallTimers(threading.current_thread())
    timers.wrap(Work, "outer")
    timers.wrap(Work, "inner")
    assert Work().outer() == 2
    other = threading.Thread(target=Work().outer)
    other.start()
    other.join()
    assert timers.calls == {"Work.outer": 1, "Work.inner": 1}
    assert timers.seconds["Work.outer"] >= timers.seconds["Work.inner"] > 0.0


def test_the_report_lists_every_target_per_call_and_per_step() -> None:
    keys = [f"{o}.{m}" for _, _, o, m in learner_calls.TARGETS]
    calls = {"seconds": dict.fromkeys(keys, 0.0), "calls": dict.fromkeys(keys, 0)}
    calls["seconds"][learner_calls.STEP], calls["calls"][learner_calls.STEP] = 2.0, 100
    calls["seconds"]["FragmentSync.push"], calls["calls"]["FragmentSync.push"] = 0.03, 10
    result = {
        "preset": "gpt-tiny",
        "device": "cpu",
        "precision": "fp32",
        "batch_size": 8,
        "seq_len": 64,
        "inner_steps": 40,
        "outer_steps": 3,
        "merge_wait": "overlap",
        "syncer_cpus": "1",
        "job_wall_s": 5.0,
        "calls": calls,
        "split": {"steps": 0},
    }
    text = learner_calls.report(result)
    push = next(line for line in text.splitlines() if "FragmentSync.push" in line)
    # 0.03 s over 10 calls: 3000 us a call; over the 100 steps: 300 us a step.
    assert push.split()[-2:] == ["3000.0", "300.0"]
    assert push.startswith("    FragmentSync.push")  # under _plan, under after_step
    assert all(k in text for k in keys)
