"""bench/busy_link's pure parts: reading the learners' window splits, the link's rate for a share
of a round, the steady bytes per round and the round's compute time; torchft's side: its delays,
its replicas' windows and its ring's bytes a round; a pinned link (--link-rates)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.busy_link import (
    Split,
    bytes_per_round,
    choose_rate,
    link_rate,
    mbit,
    parse_args,
    parse_link_rates,
    pin_args,
    port_taken,
    ring_bytes_per_round,
    round_seconds,
    seen_share,
    torchft_delays,
    torchft_split,
    window_split,
)
from bench.harness.merge_stats import MergeStaleness

PREFIX = "2026-11-28 10:00:00,000 INFO x diloco.learner: step 19 loss 3.1 tokens 1 (9 tokens/s); "
LOG = "\n".join(
    PREFIX + f"20 steps: {t}s training, {p}s sync path, {w}s waiting for the syncer; 1.00s cpu"
    for t, p, w in [
        ("9.000", "0.500", "0.500"),
        ("4.000", "0.250", "0.750"),
        ("4.500", "0.250", "0.250"),
    ]
)


def test_window_split_leaves_the_first_window_out_and_sums_the_rest() -> None:
    s = window_split(LOG)
    assert s == Split(40, 8.5, 0.5, 1.0)
    assert s.wall == pytest.approx(10.0)
    assert s.utilisation == pytest.approx(0.85)
    assert window_split(LOG, skip_first=0).steps == 60
    assert math.isnan(window_split("").utilisation)


def test_link_rate_makes_a_round_of_bytes_take_the_share() -> None:
    # 1 MB a round, a 2 s round: at 50% the link moves 1 MB in 1 s.
    assert link_rate(1e6, 2.0, 0.5) == pytest.approx(1e6)
    assert link_rate(1e6, 2.0, 1.0) == pytest.approx(5e5)
    assert link_rate(1e6, 2.0, 0.0) is None
    assert mbit(1e6) == "8 Mbit/s" and mbit(None) == "unlimited"
    with pytest.raises(ValueError):
        link_rate(0, 2.0, 0.5)


def test_bytes_per_round_is_the_slope_after_the_first_outer_step() -> None:
    # The joins' 5 MB before step 1 stay out; then 2 MB a step.
    samples = [(0, 0), (0, 5_000_000), (1, 6_000_000), (2, 8_000_000), (4, 12_000_000)]
    assert bytes_per_round(samples) == pytest.approx(2e6)
    assert math.isnan(bytes_per_round([(0, 0), (1, 5)]))


def test_round_seconds_and_the_share_a_run_saw() -> None:
    splits = [Split(20, 2.0, 0, 0), Split(20, 4.0, 0, 0), Split(20, 3.0, 0, 0)]
    assert round_seconds(splits, 30) == pytest.approx(4.5)  # H x the median 0.15 s a step
    run = {"bytes_per_round": 9e5, "splits": splits}
    assert seen_share(run, 4e5, 30) == pytest.approx(0.5)  # 9e5 B at 4e5 B/s: 2.25 s of 4.5 s
    assert seen_share(run, None, 30) == 0.0
    with pytest.raises(ValueError):
        round_seconds([Split()], 30)


def test_torchft_delays_stay_below_a_fragment_s_steps_and_keep_half_of_them() -> None:
    # One fragment, H = 30: d < 30, so 29 at most; half of the 30 steps kept: 15.
    assert torchft_delays(30) == (29, 15)
    # Three fragments: one synced every 10 steps, d < 10; 5 keeps half.
    assert torchft_delays(30, 3) == (9, 5)
    assert torchft_delays(10) == (9, 5)
    with pytest.raises(ValueError):
        torchft_delays(30, 4)  # 30 steps do not split into 4 fragments


def test_busy_link_defaults_to_delays_0_and_half_of_h_and_refuses_one_torchft_refuses() -> None:
    assert parse_args([]).torchft_delays == [0, 15]
    assert parse_args(["--quick"]).torchft_delays == [0, 5]  # H = 10
    assert parse_args(["--torchft-delays", "29"]).torchft_delays == [29]
    with pytest.raises(SystemExit):
        parse_args(["--torchft-delays", "30"])


def test_torchft_split_opens_at_the_first_commit_and_counts_the_rest_as_waiting() -> None:
    records = [
        {"time": 100.0, "commits": 0, "steps": 10, "compute_seconds": 5.0},
        {"time": 104.0, "commits": 1, "steps": 30, "compute_seconds": 12.0},
        {"time": 110.0, "commits": 1, "steps": 45, "compute_seconds": 16.0},
        {"time": 114.0, "commits": 2, "steps": 60, "compute_seconds": 20.0},
    ]
    # From 104 s to 114 s: 30 steps, 8 s of compute, the other 2 s blocked in the sync.
    s = torchft_split(records)
    assert s == Split(30, 8.0, 0.0, 2.0)
    assert s.utilisation == pytest.approx(0.8)
    assert torchft_split(records[:1]) == Split()


def test_ring_bytes_per_round_sums_the_replicas_per_commit() -> None:
    # Two replicas, 3 commits each sending 1.5 MB: 2 x 4.5 MB / 3 = 3 MB a round.
    results = [
        {"outer_steps": 3, "bytes_per_worker": 4.5e6},
        {"outer_steps": 3, "bytes_per_worker": 4.5e6},
    ]
    assert ring_bytes_per_round(results) == pytest.approx(3e6)
    assert math.isnan(ring_bytes_per_round([{"outer_steps": 0, "bytes_per_worker": 0}]))


def run(loss: float, budget: float, split: Split, rate: float | None) -> dict[str, object]:
    """A run's result as busy_link keeps it: `loss` at the budget after 10 s, 0.1 lower at
    1.25x it after 20 s."""
    history = [(0.0, 0.0, 5.0), (10.0, budget, loss), (20.0, 1.25 * budget, loss - 0.1)]
    return {
        "history": history,
        "splits": [split],
        "rate": rate,
        "bytes_per_round": 1e6,
        "up_share": 0.5,
        "staleness": MergeStaleness(),  # ours' merge log had no merges: "n/a"
    }


def test_tables_put_torchft_beside_ours_and_judge_both_verdicts() -> None:
    from bench.busy_link import tables
    from bench.decoupled_quality import budget

    args = parse_args(["--quorums", "--shares", "0", "50", "--torchft-delays", "0"])
    b = budget(args)
    ours = {
        (0, 4, 0.0): run(3.0, b, Split(20, 9.0, 0.5, 0.5), None),
        (0, 4, 50.0): run(3.03, b, Split(20, 8.0, 1.0, 1.0), 2e6),
    }
    tft = {
        (0, 0, 0.0): run(2.95, b, Split(20, 9.5, 0.0, 0.5), None),
        (0, 0, 50.0): run(2.95, b, Split(20, 6.0, 0.0, 4.0), 2e6),
    }
    main, verdicts = tables(args, ours, tft)
    rows = {(r[0], r[1]): r for r in main.rows}
    # torchft at 50%: 6 of 10 s training; its loss as at L = 0; it reaches ours' L = 0 loss
    # (3.0) at its budget evaluation, 10 s, as ours' own run did.
    assert rows[("torchft 4, delay 0", "50%")][4:] == [
        "0.600", "40.0%", "-", "2.9500", "1.000x", "1.000x", "-", "-"
    ]  # fmt: skip
    assert rows[("4 (= M)", "50%")][-1] == "n/a"
    # Ours at 50%: the L = 0 run reached its loss at 10 s; the last pushes then take half of a
    # round's 1 MB at 2 MB/s, 0.25 s more: a floor of 10.25 / 10.
    assert rows[("4 (= M)", "50%")][-2] == "1.025x"
    assert rows[("4 (= M)", "0%")][-2] == "1.000x"
    judged = {(r[0], r[1], r[2]): (r[3], r[4]) for r in verdicts.rows}
    # L = 0: ours 0.900 against torchft's 0.950, behind; L = 50%: 0.800 against 0.600, ahead.
    assert judged[("4", "0%", "utilisation ahead of torchft's")] == (
        "0.900 vs 0.950 (delay 0)", "MISSED"
    )  # fmt: skip
    assert judged[("4", "50%", "utilisation ahead of torchft's")][1] == "met"
    assert judged[("4", "50%", "loss at or below torchft's")] == (
        "3.0300 vs 2.9500 (delay 0)", "MISSED"
    )  # fmt: skip
    # Ours at 50% reached 3.0 at its 20 s evaluation (past the budget): twice the L = 0 run's.
    assert judged[("4", "50%", "time to target <= 1.05x")] == (
        "2.000x (the link's floor 1.025x)", "MISSED"
    )  # fmt: skip


def test_time_to_target_reads_both_offline_curves_between_their_checkpoints() -> None:
    from bench.busy_link import time_to_target

    # The L = 0 run's offline loss at the budget (1,500 tokens) is 2.5, which its own curve
    # crosses halfway between its checkpoints at 10 s (3.0) and 20 s (2.0): 15 s. The other
    # run's curve crosses 2.5 at 12 + 10 x (3.2 - 2.5) / (3.2 - 2.2) = 19 s.
    r0 = {
        "history": [(0.0, 0.0, 12.0), (10.0, 1000.0, 9.0)],  # live: read only below
        "offline_loss": (1500.0, 2.5),
        "offline_history": [(0.0, 0.0, 5.0), (10.0, 1000.0, 3.0), (20.0, 2000.0, 2.0)],
    }
    r = {
        "history": [(0.0, 0.0, 5.0)],
        "offline_history": [(0.0, 0.0, 5.0), (12.0, 1000.0, 3.2), (22.0, 2000.0, 2.2)],
    }
    assert time_to_target(r, r0, 1500.0) == pytest.approx((19.0, 15.0))
    # Without an offline curve on either side: the live evaluations', the first at or below
    # r0's live loss at the budget (9.0 at 1,000 tokens, the last point: interpolation holds).
    live = {"history": [(0.0, 0.0, 12.0), (7.0, 1000.0, 8.5)]}
    assert time_to_target(live, r0, 1000.0) == pytest.approx((7.0, 10.0))


def test_crossing_time_and_link_floor_doctests_pass() -> None:
    import doctest

    import bench.busy_link

    runner = doctest.DocTestRunner()
    for fn in (bench.busy_link.crossing_time, bench.busy_link.link_floor):
        for test in doctest.DocTestFinder().find(fn):
            runner.run(test)
    assert (runner.failures, runner.tries) == (0, 5)


def test_parse_link_rates_reads_l_equals_mbit_as_bytes_per_second() -> None:
    # 8 Mbit/s = 1e6 B/s; 6.85 Mbit/s = 856,250 B/s.
    assert parse_link_rates(["50=8", "100=6.85"]) == {50.0: 1e6, 100.0: 856_250.0}
    assert parse_link_rates([]) == {}
    for bad in (["50"], ["0=8"], ["50=0"], ["50=-1"], ["x=8"], ["50=inf"], ["50=8", "50.0=4"]):
        with pytest.raises(ValueError):
            parse_link_rates(bad)


def test_choose_rate_takes_the_pinned_rate_over_the_seed_s_calibration() -> None:
    calib = {"bytes": 1e6, "round": 2.0}  # 1 MB a 2 s round: 1e6 B/s at 50%, 5e5 at 100%
    pinned = {100.0: 2.5e5}
    assert choose_rate(0, pinned, calib) == (None, False)
    assert choose_rate(100, pinned, calib) == (2.5e5, True)
    assert choose_rate(100, pinned, {}) == (2.5e5, True)  # no calibration needed
    assert choose_rate(50, pinned, calib) == (pytest.approx(1e6), False)
    assert choose_rate(50, {}, calib) == (pytest.approx(1e6), False)
    with pytest.raises(SystemExit):
        choose_rate(50, pinned, {})  # neither pinned nor calibrated


def test_pin_args_prints_a_calibration_s_links_as_link_rates() -> None:
    # 1 MB a 2 s round: 25% -> 2e6 B/s = 16 Mbit/s, 50% -> 8, 100% -> 4; L = 0 has no rate.
    calib = {"bytes": 1e6, "round": 2.0}
    assert pin_args(calib, [100, 0, 25, 50, 50]) == "--link-rates 25=16 50=8 100=4"
    # 4 significant digits: 1 MB a 3 s round at 100% is 2.6666... Mbit/s.
    assert pin_args({"bytes": 1e6, "round": 3.0}, [100]) == "--link-rates 100=2.667"
    assert parse_link_rates(pin_args(calib, [50]).split()[1:]) == {50.0: 1e6}


def test_busy_link_pins_every_share_or_none() -> None:
    assert parse_args([]).link_rates == {}  # the default: each seed's own calibration
    args = parse_args(["--shares", "0", "50", "100", "--link-rates", "50=8", "100=4"])
    assert args.link_rates == {50.0: 1e6, 100.0: 5e5}
    with pytest.raises(SystemExit):
        parse_args(["--shares", "0", "50", "100", "--link-rates", "100=4"])  # 50% unpinned
    with pytest.raises(SystemExit):
        parse_args(["--link-rates", "50=fast"])


def test_tables_mark_a_pinned_link() -> None:
    from bench.busy_link import tables
    from bench.decoupled_quality import budget

    args = parse_args(["--quorums", "--shares", "0", "50", "--link-rates", "50=16"])
    b = budget(args)
    ours = {
        (0, 4, 0.0): run(3.0, b, Split(20, 9.0, 0.5, 0.5), None),
        (0, 4, 50.0): run(3.03, b, Split(20, 8.0, 1.0, 1.0), 2e6),
    }
    main, _ = tables(args, ours)
    rows = {(r[0], r[1]): r for r in main.rows}
    assert rows[("4 (= M)", "50%")][2] == "16 Mbit/s (pinned), RTT 20 ms"
    assert rows[("4 (= M)", "0%")][2] == "unlimited"


def test_port_taken_reads_the_syncers_capitalised_strerror() -> None:
    # The syncer's message as launch.wait_ready raises it (edge/limits.ListenError: strerror as
    # the OS gives it, capital A); a case-sensitive match never retried (mini100's run).
    taken = RuntimeError(
        "syncer exited with 1 before it was ready: diloco syncer: cannot listen on "
        "0.0.0.0:39533: Address already in use"
    )
    assert port_taken(taken)
    assert not port_taken(RuntimeError("syncer exited with 1 before it was ready: bad spec"))


def test_offline_loss_interpolates_the_two_checkpoints_around_the_budget(tmp_path: Path) -> None:
    # Three checkpoints of a gpt-tiny job (the initial weights, then two perturbations of them),
    # written at t = 10, 20, 30 s while one island's progress lines went 0 -> 3000 tokens
    # processed in 30 s: the budget, 1500 tokens, sits between the ones at 1000 (t = 10) and
    # 2000 (t = 20), halfway, so the figure is the mean of those two checkpoints' losses on the
    # wider evaluation set, and the third never counts.
    import json

    import torch
    from diloco_trainer.api.spec import JobSpec
    from diloco_trainer.models.parts import build_parts, evaluate
    from safetensors.torch import save_model

    from bench.busy_link import offline_history, offline_loss, offline_spec

    spec = JobSpec.model_validate(
        {"model": {"preset": "gpt-tiny"}, "inner": {"seqLen": 32, "batchSize": 4}}
    )
    assert offline_spec(spec).syncer.checkpoint.every_outer_steps == 1
    assert offline_spec(spec).syncer.checkpoint.keep == 100
    wide = spec.model_copy(update={"data": spec.data.model_copy(update={"eval_tokens": 256})})
    parts = build_parts(wide, shard_index=0, num_shards=1, with_train=False)
    losses = []
    for n, scale in enumerate([0.0, 0.5, 1.0]):
        with torch.no_grad():
            for i, p in enumerate(parts.model.parameters()):
                p.add_(scale * 0.01 * torch.sin(torch.arange(p.numel()).reshape(p.shape) + i))
        losses.append(evaluate(parts))
        folder = tmp_path / "syncer" / "checkpoints" / f"ckpt-{n + 1:09d}"
        folder.mkdir(parents=True)
        save_model(parts.model, str(folder / "weights.safetensors"))
        (folder / "manifest.json").write_text(json.dumps({"time": 10.0 * (n + 1)}))
    assert len(set(losses)) == 3
    r = {"workdir": tmp_path, "progress": {0: [(0.0, 0), (30.0, 3000)]}}
    assert offline_loss(spec, r, 1500.0, 256) == pytest.approx((losses[0] + losses[1]) / 2)
    assert offline_loss(spec, r, 2000.0, 256) == pytest.approx(losses[1])  # on one
    assert math.isnan(offline_loss(spec, r, 3500.0, 256))  # past the last: nothing brackets it
    # The whole curve time to target reads: every checkpoint at its seconds from the run's
    # start (t0 = 4 s) and the tokens processed when it was written.
    curve = offline_history(spec, {**r, "t0": 4.0}, 256)
    assert [(t, n) for t, n, _ in curve] == [(6.0, 1000.0), (16.0, 2000.0), (26.0, 3000.0)]
    assert [loss for _, _, loss in curve] == pytest.approx(losses)


def test_equal_token_loss_reads_the_offline_figure_only_where_it_was_measured() -> None:
    from bench.busy_link import equal_token_loss

    r = run(3.0, 1000.0, Split(20, 9.0, 0.5, 0.5), None)
    assert equal_token_loss(r, 1000.0) == pytest.approx(3.0)  # none: the live evaluations'
    r["offline_loss"] = (1000.0, 2.95)
    assert equal_token_loss(r, 1000.0) == pytest.approx(2.95)
    assert equal_token_loss(r, 1250.0) == pytest.approx(2.9)  # not read there: the live 2.9


def test_busy_link_reads_offline_on_32k_tokens_by_default_and_refuses_a_negative_count() -> None:
    assert parse_args([]).offline_eval_tokens == 32768
    assert parse_args(["--offline-eval-tokens", "0"]).offline_eval_tokens == 0
    assert parse_args(["--quick"]).offline_eval_tokens == 1024  # the smoke run stays quick
    with pytest.raises(SystemExit):
        parse_args(["--offline-eval-tokens", "-1"])


def test_checkpoints_around_doctests_pass() -> None:
    import doctest

    import bench.busy_link

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(bench.busy_link.checkpoints_around):
        runner.run(test)
    assert (runner.failures, runner.tries) == (0, 3)


def test_paced_learners_get_the_pace_in_seconds() -> None:
    """--pace-step-ms 200: every learner's DILOCO_PACE_STEP_SECONDS is 0.2; 0 sets none."""
    from bench.busy_link import paced

    assert paced(200.0) == {"DILOCO_PACE_STEP_SECONDS": "0.2"}
    assert paced(0.0) is None
