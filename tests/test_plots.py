"""Plots of a run and of one rollout's timeline, and metrics records with dict / list fields."""

import json
import math
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest

from tlt_jax.metrics import plots, timing
from tlt_jax.metrics.writer import MetricsWriter, read_metrics, tensorboard_values

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
THRESHOLD = 4


def assert_png(path, min_width=300):
    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 5_000  # axes, ticks and text, not a blank canvas
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width >= min_width and height >= 200


def synthetic_timeline(tail_arm="ngram:4,1,5"):
    """16 requests, one finishing every 4 steps; at most THRESHOLD running from step 48 on, where
    `tail_arm` runs every step but every fourth (plain, as the bandit's plain arm)."""
    rows, t = [], 0.0
    for step in range(64):
        running = 16 - step // 4
        arm = tail_arm if running <= THRESHOLD and step % 4 else "plain"
        t += 0.01 if arm == "plain" else 0.004
        rows.append((t, running, arm))
    return rows


def greenish_pixels(path):
    """Pixels of the n-gram shading (tab:green blended over white or grey)."""
    rgb = matplotlib.image.imread(path)[..., :3] * 255.0
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return int(((g - r > 30) & (g - b > 30)).sum())


def tlt_record(step, **overrides):
    record = {
        "step": step,
        "reward_mean": 0.1 * step,
        "accuracy": 0.05 * step,
        "sd_step_share": 0.25,
        "sd_steps": 12,
        "sd_threshold": THRESHOLD,
        "accept_len_ngram": 2.5,
        "accept_len_eagle": float("nan"),
        "sd_choices": {"1/ngram:4,1,5": np.int64(7), "2/plain": 3, "4/eagle:8,4,16": 2},
        "long_tail_share": 0.4,
        "long_tail_s": 0.8,
        "sd_tail_s": 0.5,
        "rollout_decode_s": 2.0,
        "response_lengths": [np.int64(n) for n in (3, 17, 40, 64, 64)],
        **{f"time_{phase}": 0.1 for phase in timing.PHASES},
    }
    record.update(overrides)
    return record


def test_rollout_timeline_shades_sd_steps_and_keeps_the_timeline(tmp_path):
    timeline = synthetic_timeline()
    paths = plots.save_timeline(timeline, THRESHOLD, tmp_path / plots.TIMELINE_FILE,
                                title="step 3 rollout")  # fmt: skip
    assert paths == [tmp_path / "rollout_timeline.json", tmp_path / "rollout_timeline.png"]
    assert_png(paths[1], min_width=600)
    doc = json.loads(paths[0].read_text())
    stats = timing.tail_stats(timeline, THRESHOLD)
    assert {k: doc[k] for k in stats} == pytest.approx(stats)
    assert 0.0 < doc["long_tail_share"] < 1.0 and doc["sd_tail_s"] > 0.0
    rows, threshold = plots.load_timeline(paths[0])
    assert threshold == THRESHOLD
    assert rows == [(pytest.approx(t), n, a, 0.0) for t, n, a in timeline]

    # The n-gram steps are shaded in their colour; a plain rollout has none of it.
    plain = plots.plot_rollout_timeline(synthetic_timeline("plain"), THRESHOLD,
                                        tmp_path / "plain.png")  # fmt: skip
    assert_png(plain, min_width=600)
    assert greenish_pixels(plain) == 0
    assert greenish_pixels(paths[1]) > 2_000  # the tail's bands, far more than a legend patch


def test_step_time_is_the_steps_wall_time_and_the_phases_add_up_to_it():
    """Host work between the timed phases (prompt encoding, the micro-batch plan) counts in
    `step_time`, as `time_host`: `step_time` was the sum of the phases alone."""
    import time

    timer = timing.PhaseTimer()
    time.sleep(0.05)  # untimed host work
    with timer.phase("rollout"):
        time.sleep(0.02)
    out = timer.metrics()
    assert set(out) == {f"time_{p}" for p in timing.PHASES} | {"step_time"}
    assert out["step_time"] >= 0.07 and out["time_host"] >= 0.05
    assert out["step_time"] == pytest.approx(sum(out[f"time_{p}"] for p in timing.PHASES))


def test_a_rollout_all_in_its_tail_has_a_share_of_exactly_one():
    """The durations' float sum can pass the last step's end by an ulp: the trainer test saw
    `long_tail_share` 1.0000000000000002 (this generator's 11th timeline does the same)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 400))
        ends = np.cumsum(rng.random(n) * 10 ** rng.uniform(-4, 1, n))
        stats = timing.tail_stats([(float(t), 2, "plain") for t in ends], THRESHOLD)
        assert stats["long_tail_share"] == 1.0
        assert stats["long_tail_s"] == stats["rollout_decode_s"]


def test_timeline_rows_without_arm_are_plain(tmp_path):
    timeline = [(0.1, 8), (0.2, 3), (0.3, 1)]
    path = plots.plot_rollout_timeline(timeline, 3, tmp_path / "t.png")
    assert_png(path)
    assert greenish_pixels(path) == 0
    json_path, _ = plots.save_timeline(timeline, 3, tmp_path / "t.json")
    assert plots.load_timeline(json_path)[0] == [(0.1, 8, "plain", 0.0), (0.2, 3, "plain", 0.0),
                                                 (0.3, 1, "plain", 0.0)]  # fmt: skip
    # A file written before the compile seconds column reads back with three fields.
    doc = json.loads(json_path.read_text())
    doc["rows"] = [row[:3] for row in doc["rows"]]
    json_path.write_text(json.dumps(doc))
    assert plots.load_timeline(json_path)[0][0] == (0.1, 8, "plain")


def test_timeline_with_compiles_keeps_them_and_leaves_them_out_of_the_tail(tmp_path):
    timeline = [(1.0, 8, "plain", 0.5), (2.0, 3, "plain", 0.0), (5.0, 1, "plain", 2.5)]
    json_path, png = plots.save_timeline(timeline, 3, tmp_path / "t.json")
    assert_png(png)
    doc = json.loads(json_path.read_text())
    assert doc["columns"][-1] == "compile_s" and doc["rows"][2] == [5.0, 1, "plain", 2.5]
    # Without the 3 s of compiles the steps end at 0.5, 1.5, 2.0: the tail is 1.5 of 2 s.
    assert doc["long_tail_share"] == pytest.approx(0.75) and doc["rollout_compile_s"] == 3.0
    assert plots.load_timeline(json_path)[0] == timeline


def test_arm_source():
    assert plots.arm_source("ngram:4,1,5") == "ngram"
    assert plots.arm_source("eagle:8,4,16") == "eagle"
    assert plots.arm_source("plain") == "plain"


def test_length_histogram(tmp_path):
    lengths = [3, 17, 17, 40, 64, 64, 64, 100]
    assert_png(plots.plot_length_histogram(lengths, 100, tmp_path / "h.png"))
    assert_png(plots.plot_length_histogram(lengths, None, tmp_path / "nocap.png"))


def test_tlt_vs_plain(tmp_path):
    tlt = [tlt_record(s, time_rollout=1.0) for s in range(1, 6)]
    plain = [tlt_record(s, time_rollout=2.0, reward_mean=0.1 * s + 0.01) for s in range(1, 6)]
    path = plots.plot_tlt_vs_plain(tlt, plain, tmp_path / "sub" / "vs.png")
    assert_png(path, min_width=800)
    assert_png(plots.plot_tlt_vs_plain(tlt, [], tmp_path / "tlt_only.png"), min_width=800)


def test_empty_inputs_write_a_plot_that_says_so(tmp_path):
    """The choice made for empty inputs: never raise (plots run inside the training loop), write
    the PNG with "no data" text; `write_plots` with no records writes nothing."""
    assert_png(plots.plot_rollout_timeline([], THRESHOLD, tmp_path / "t.png"))
    assert plots.save_timeline([], THRESHOLD, tmp_path / "t.json")[0].is_file()
    assert plots.load_timeline(tmp_path / "t.json") == ([], THRESHOLD)
    assert_png(plots.plot_length_histogram([], 64, tmp_path / "h.png"))
    assert_png(plots.plot_length_histogram([], None, tmp_path / "h0.png"))
    assert_png(plots.plot_tlt_vs_plain([], [], tmp_path / "vs.png"))
    # A rollout that never reached the threshold: no tail, still a plot.
    assert_png(plots.plot_rollout_timeline([(0.1, 8, "plain")], 2, tmp_path / "notail.png"))
    assert plots.write_plots([], tmp_path / "none") == []
    assert not (tmp_path / "none").exists()


def test_wrong_inputs_raise(tmp_path):
    with pytest.raises(ValueError, match="threshold=-1"):
        plots.plot_rollout_timeline([(0.1, 2, "plain")], -1, tmp_path / "t.png")
    with pytest.raises(ValueError, match=r"timeline\[1\]"):
        plots.save_timeline([(0.1, 2, "plain"), (0.2,)], 2, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_write_plots_with_tlt_fields_after_a_jsonl_round_trip(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 4):
        # accept_len_eagle is NaN ("nan" in JSON); step 2 ran no SD at all.
        writer.write(tlt_record(step, sd_choices={} if step == 2 else tlt_record(0)["sd_choices"]))
    records = read_metrics(tmp_path)
    paths = plots.write_plots(records, tmp_path / "plots", cap=64)
    assert paths == [tmp_path / "plots" / name for name in plots.PLOT_FILES]
    for path in paths:
        assert_png(path)


def test_write_plots_without_tlt_fields(tmp_path):
    records = [{"step": s, "reward_mean": 0.1, "accuracy": 0.2, "response_lengths": [1, 2]}
               for s in (1, 2)]  # fmt: skip
    paths = plots.write_plots(records, tmp_path)
    assert [p.name for p in paths] == list(plots.PLOT_FILES[:4])
    assert not (tmp_path / "tlt_per_step.png").exists()
    # A last step without response lengths still gets its (empty) histogram.
    paths = plots.write_plots(records + [{"step": 3, "reward_mean": 0.1}], tmp_path / "b")
    assert_png(paths[3])


def test_writer_round_trips_dict_and_list_fields(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    record = tlt_record(1, extra={"nested": {"a": np.float32(0.5)}, "bad": float("inf")},
                        array=np.arange(3), note="text")  # fmt: skip
    writer.write(record)
    writer.write(tlt_record(2))
    first, second = read_metrics(tmp_path)
    assert first["sd_choices"] == {"1/ngram:4,1,5": 7, "2/plain": 3, "4/eagle:8,4,16": 2}
    assert first["response_lengths"] == [3, 17, 40, 64, 64]
    assert first["extra"] == {"nested": {"a": 0.5}, "bad": "inf"}
    assert first["array"] == [0, 1, 2] and first["note"] == "text"
    assert first["accept_len_eagle"] == "nan" and first["accept_len_ngram"] == 2.5
    assert second["step"] == 2 and second["sd_choices"] == first["sd_choices"]
    # Resume: the records of later steps go; dicts and lists survive the rewrite.
    writer.truncate_after(1)
    assert read_metrics(tmp_path) == [first]


def test_tensorboard_values_flatten_dicts_and_keep_numbers():
    record = tlt_record(5, skipped=True, note="text", empty=[], nested={"a": {"b": 2}})
    scalars, histograms = tensorboard_values(record)
    assert "step" not in scalars
    assert scalars["sd_choices/1/ngram_4_1_5"] == 7.0  # ':' and ',' are not allowed in tags
    assert scalars["sd_choices/2/plain"] == 3.0
    assert scalars["sd_choices/4/eagle_8_4_16"] == 2.0
    assert scalars["nested/a/b"] == 2.0
    assert scalars["sd_step_share"] == 0.25 and scalars["sd_threshold"] == THRESHOLD
    assert math.isnan(scalars["accept_len_eagle"])
    assert "sd_choices" not in scalars and "skipped" not in scalars and "note" not in scalars
    assert set(histograms) == {"response_lengths"}
    np.testing.assert_array_equal(histograms["response_lengths"], [3, 17, 40, 64, 64])
    _, histograms = tensorboard_values({"step": 1, "x": [1.0, float("nan")], "y": [float("nan")]})
    assert set(histograms) == {"x"} and histograms["x"].tolist() == [1.0]


class RecordingSummaryWriter:
    def __init__(self, logdir):
        self.logdir, self.scalars, self.histograms = logdir, {}, {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag, step] = value

    def add_histogram(self, tag, values, step):
        self.histograms[tag, step] = list(values)

    def flush(self):
        pass

    def close(self):
        pass


def test_writer_sends_flattened_values_to_tensorboard(tmp_path, monkeypatch):
    import tensorboardX

    tb = RecordingSummaryWriter(None)

    def summary_writer(logdir):
        tb.logdir = logdir
        return tb

    monkeypatch.setattr(tensorboardX, "SummaryWriter", summary_writer)
    writer = MetricsWriter(tmp_path)
    writer.write(tlt_record(3))
    assert tb.logdir == str(tmp_path / "tensorboard")
    assert tb.scalars["sd_choices/1/ngram_4_1_5", 3] == 7.0
    assert tb.scalars["long_tail_share", 3] == 0.4
    assert ("accept_len_ngram", 3) in tb.scalars and ("step", 3) not in tb.scalars
    assert tb.histograms == {("response_lengths", 3): [3, 17, 40, 64, 64]}


def test_writer_tensorboard_accepts_a_tlt_record(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(tlt_record(1))
    writer.close()
    # Read back from the event file, by hand: every scalar at step 1 (NaN included), by tag.
    shown = _tensorboard_view(tmp_path / "tensorboard")
    assert shown[("sd_choices/1/ngram_4_1_5", 1)] == 7.0 and shown[("sd_steps", 1)] == 12.0
    assert np.isnan(shown.pop(("accept_len_eagle", 1)))
    want = {k: v for k, v in tensorboard_values(tlt_record(1))[0].items() if not np.isnan(v)}
    assert shown == pytest.approx({(tag, 1): value for tag, value in want.items()}, rel=1e-6)


def _tensorboard_view(logdir):
    """(tag, step) -> value as TensorBoard shows the event files of `logdir`: files in name
    order, and a `SessionLog.START` at step s hides the events of steps >= s before it."""
    import struct

    from tensorboardX.proto import event_pb2

    shown = {}
    for path in sorted(logdir.iterdir()):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            if event.session_log.status == event_pb2.SessionLog.START:
                shown = {k: v for k, v in shown.items() if k[1] < event.step}
            for value in event.summary.value:
                if value.WhichOneof("value") != "simple_value":
                    continue  # histograms
                assert (value.tag, event.step) not in shown, "a step logged twice"
                shown[value.tag, event.step] = value.simple_value
    return shown


def test_resume_purges_the_abandoned_steps_from_tensorboard(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in range(1, 6):
        writer.write({"step": step, "loss": float(step)})
    writer.close()  # the run died after step 5; its last checkpoint is step 3
    for path in (tmp_path / "tensorboard").iterdir():  # (an earlier second's file name)
        path.rename(path.with_name("events.out.tfevents.0.old"))
    resumed = MetricsWriter(tmp_path)
    resumed.truncate_after(3)
    for step in (4, 5):
        resumed.write({"step": step, "loss": 10.0 * step})
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert _tensorboard_view(tmp_path / "tensorboard") == {
        ("loss", 1): 1.0,
        ("loss", 2): 2.0,
        ("loss", 3): 3.0,
        ("loss", 4): 40.0,
        ("loss", 5): 50.0,
    }


def test_resume_after_a_torn_last_record(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        writer.write({"step": step, "response_lengths": list(range(3000))})
    line = json.dumps({"step": 4, "response_lengths": list(range(3000))})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(line[:8192])  # killed (or out of disk) while appending step 4
    MetricsWriter(tmp_path, tensorboard=False).truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": \n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON record"):
        read_metrics(tmp_path)


def test_benchmark_json_is_strict_and_metrics_keep_non_finite_values_readable(tmp_path):
    """A benchmark figure with nothing measured (NaN) is null in its JSON, which any JSON
    reader parses (`json.dumps` would write the bare NaN that strict readers refuse); numpy
    values become Python ones. A metrics record keeps "nan" / "inf" as strings."""
    from tlt_jax.files import jsonable, to_json, write_json

    result = {"ratio": {1: np.float32(2.5), 32: float("nan")}, "runs": np.arange(2),
              "best": float("inf"), "name": "x"}  # fmt: skip
    path = write_json(tmp_path / "bench.json", result)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text, parse_constant=pytest.fail) == {
        "ratio": {"1": 2.5, "32": None},
        "runs": [0, 1],
        "best": None,
        "name": "x",
    }
    assert json.loads(to_json(result, indent=None))["ratio"]["32"] is None
    assert jsonable({"loss": float("nan"), "kl": -math.inf}) == {"loss": "nan", "kl": "-inf"}


def test_the_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX's writer imports torch when it is installed (2.5 s of every run's start
    here); a fresh process writes its events without it, and torch still imports after.
    A NaN written on purpose is not warned about (five log lines a step of a TLT run)."""
    pytest.importorskip("torch")
    code = ("import sys; from tlt_jax.metrics.writer import MetricsWriter; "
            f"w = MetricsWriter({str(tmp_path)!r}); "
            "w.write({'step': 1, 'loss': 0.5, 'accept_len_eagle': float('nan')}); "
            "w.close(); assert 'torch' not in sys.modules, 'torch imported'; "
            "import torch; print(torch.zeros(2).sum().item())")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "0.0" and "NaN or Inf" not in run.stderr, run.stderr
    shown = _tensorboard_view(tmp_path / "tensorboard")
    assert np.isnan(shown.pop(("accept_len_eagle", 1))) and shown == {("loss", 1): 0.5}
