"""README's numbers are the result files' numbers (scripts/readme_numbers.py), and bench/summary.py picks runs
by the date recorded inside them."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import readme_numbers as rn  # noqa: E402

README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"


def test_readme_numbers_match_their_result_files(capsys):
    text = README.read_text()
    kinds = {b.kind for b in rn.blocks(text)}
    assert {"io-seq", "io-ops", "checkpoint", "metrics", "gpu", "train"} <= kinds
    assert rn.main(["--check"]) == 0, capsys.readouterr().out  # the diff says what drifted


def test_no_measured_figure_outside_a_generated_block():
    hits = rn.unsourced_figures(README.read_text())
    assert hits == [], (
        "README quotes measured figures by hand; put them in a `<!-- numbers:KIND source=bench/results/X.json -->`"
        " block rendered by scripts/readme_numbers.py (add a renderer for a new kind)"
    )


def test_every_block_cites_a_json_result_file_under_bench_results():
    for b in rn.blocks(README.read_text()):
        assert b.source.startswith("bench/results/") and b.source.endswith(".json"), b.source
        assert (ROOT / b.source).is_file(), b.source


def test_the_checkpoint_figures_are_the_quiet_runs():
    """Issue 16: an under-load (or smoke) run must not stand in for the quiet run README cites, and the
    block's figures are the cited file's own (the 2026-11-30 under-load run's 0.95x / 6.2x were once
    pasted over the quiet file's)."""
    (block,) = [b for b in rn.blocks(README.read_text()) if b.kind == "checkpoint"]
    src = json.loads((ROOT / block.source).read_text())
    for word in ("under-load", "underload", "smoke", "run-under"):
        assert word not in block.source and word not in src.get("label", ""), block.source
    assert block.body == rn.render("checkpoint", block.source)
    if block.source == "bench/results/checkpoint-2026-11-30.json":
        for figure in ("0.82x", "5.58x", "0.92x", "1.02x", "28.3%"):
            assert figure in block.body
        assert "0.95x dsio" not in block.body and "6.20x" not in block.body


def _copy_tree(tmp_path: Path) -> Path:
    (tmp_path / "bench" / "results").mkdir(parents=True)
    for b in rn.blocks(README.read_text()):
        shutil.copy(ROOT / b.source, tmp_path / b.source)
    shutil.copy(README, tmp_path / "README.md")
    return tmp_path / "README.md"


def test_a_changed_result_file_is_detected_and_regenerated(tmp_path, capsys):
    readme = _copy_tree(tmp_path)
    assert rn.main(["--check", "--readme", str(readme)]) == 0
    (block,) = [b for b in rn.blocks(readme.read_text()) if b.kind == "checkpoint"]  # whichever run it cites
    src = tmp_path / block.source
    data = json.loads(src.read_text())
    (vs_st,) = [t for t in data["targets"] if "durable save" in t["target"] and "safetensors" in t["target"]]
    vs_st["value"] = 9.99
    src.write_text(json.dumps(data))
    assert rn.main(["--check", "--readme", str(readme)]) == 1
    assert "9.99x" in capsys.readouterr().out
    assert rn.main(["--readme", str(readme)]) == 0  # regenerate
    assert "9.99x safetensors" in readme.read_text()
    assert rn.main(["--check", "--readme", str(readme)]) == 0


def test_a_hand_edited_number_is_detected(tmp_path):
    readme = _copy_tree(tmp_path)
    text = readme.read_text()
    (block,) = [b for b in rn.blocks(text) if b.kind == "checkpoint"]  # whichever run it cites
    start = text.index(f"source={block.source}")
    figure = re.search(r"\d+\.\d+x", text[start:])  # its first ratio, e.g. "0.77x"
    assert figure is not None
    edited = f"{float(figure.group()[:-1]) + 0.11:.2f}x"
    at = start + figure.start()
    readme.write_text(text[:at] + edited + text[at + len(figure.group()) :])
    assert rn.main(["--check", "--readme", str(readme)]) == 1
    readme.write_text(text + "\nA dedicated run: 1.88-1.95 GB/s.\n")
    assert rn.unsourced_figures(readme.read_text())


def test_bad_blocks_raise_numbers_error(tmp_path):
    with pytest.raises(rn.NumbersError):
        rn.render("no-such-kind", "bench/results/checkpoint-2026-11-30.json")
    with pytest.raises(rn.NumbersError):
        rn.render("checkpoint", "bench/results/missing.json")
    with pytest.raises(rn.NumbersError):
        rn.render("checkpoint", "bench/results/checkpoint-2026-11-30.md")
    with pytest.raises(rn.NumbersError):  # a file of another kind lacks what the block needs
        rn.render("checkpoint", "bench/results/2026-11-30-vm-io.json")


def _derived() -> list[tuple[dict, str]]:
    out = []
    for p in sorted(RESULTS.glob("*.json")):
        d = json.loads(p.read_text())
        if isinstance(d, dict) and d.get("derived_from"):
            out.append((d, (RESULTS / d["derived_from"]).read_text()))
    return out


def test_json_re_derived_from_a_report_says_so_and_matches_it():
    derived = _derived()
    assert {d["kind"] for d, _ in derived} >= {"checkpoint", "metrics_overhead"}
    for d, md in derived:
        assert d["derivation"]
        if d["kind"] == "checkpoint":
            assert f"# dsio.checkpoint benchmark, {d['meta']['date']}" in md
            for t in d["targets"]:
                shown = f"{t['value']:.2f}x" if t["unit"] == "x" else f"{t['value']:.1f}%"
                assert f"| {t['target']} | {shown} | {'yes' if t['met'] else 'no'} |" in md
            for name, r in d["rows"].items():
                assert (
                    f"| {name} | {r['seconds_median']:.2f} ({r['seconds_min']:.2f}-{r['seconds_max']:.2f}) "
                    f"| {r['gbps_median']:.2f} ({r['gbps_min']:.2f}-{r['gbps_max']:.2f}) |"
                ) in md
            for name, xs in d["seconds"].items():
                assert f"- {name}: {', '.join(f'{x:.2f}' for x in xs)}" in md
        else:
            for mode, r in d["modes"].items():
                assert (
                    f"| {mode} | {r['windows']} | {r['ops_per_s_median']:,.0f} | {r['ops_per_s_min']:,.0f} "
                    f"| {r['ops_per_s_max']:,.0f} | {r['cpu_us_per_op_median']:.2f}"
                ) in md
            assert f"**{d['cpu_per_op_change_pct']:+.2f}%** CPU per op" in md
            assert f"One scrape costs {d['scrape_cpu_us']:.0f} us of CPU ({d['scrape_bytes']:,} bytes" in md


def test_bench_checkpoint_writes_the_schema_the_readme_reads():
    """A fresh bench/checkpoint.py run renders: its to_json() output feeds the README's checkpoint block."""
    ck = pytest.importorskip("bench.checkpoint")
    names = [n for n, _ in ck.SAVES + ck.LOADS]
    names += ["dsio async save: blocked", "dsio async save: until staged", "DCP async_save: blocked"]
    times = {n: [2.0, 2.2, 2.1] for n in names}
    times["dsio Checkpointer save (durable)"] = [1.0, 1.2, 1.1]  # 2.1 / 1.1 = 1.91x the others
    times["dsio async save: blocked"] = [0.055, 0.055, 0.055]  # 5% of 1.1 s
    times["dsio async save: until staged"] = [0.44, 0.44, 0.44]  # 40% of 1.1 s
    cpu = {n: [0.5, 0.5, 0.5] for n in names}
    b = SimpleNamespace(
        times=times,
        cpu=cpu,
        phases={"staging": [0.3, 0.3, 0.3]},
        nbytes=3 << 30,
        flat={f"t{i}": None for i in range(7)},
        ckpt=SimpleNamespace(copy_threads=2),
        order=[["dsio raw write (new file, ceiling)", "dsio Checkpointer save (durable)"]],
    )
    args = SimpleNamespace(layers=2, dim=64, vocab=128, label="")
    cores = {"crc32c": 12.0, "memcpy": 6.0, "fresh memory first touch": 3.0}
    data = json.loads(json.dumps(ck.to_json(b, {"date": "2026-12-01 10:00 UTC"}, 3, 5e9, args, cores)))
    text = rn.RENDERERS["checkpoint"](data, "bench/results/checkpoint-x.json")
    assert "1.91x dsio's raw new-file write (target 0.95x)" in text and "1.91x safetensors" in text
    # the resources' rates of the same run: disk 3 GiB / 2.1 s; staging 1 / (1/6 + 1/12) = 4 GB/s per core
    disk = (3 << 30) / 2.1 / 1e9
    copiers = min(2, os.cpu_count() or 1)
    assert f"the disk wrote {disk:.2f} GB/s and read {disk:.2f} GB/s (raw)" in text
    assert f"runs at {4.0 * copiers:.2f} GB/s on the {copiers} copier threads, crc32c at 12.00 GB/s" in text
    assert "first touch of fresh memory at 3.00 GB/s per core" in text
    assert "5.0% of a synchronous save" in text and "(target 5%: met)" in text
    assert "the state may change again 40% of the way into the save" in text
    assert data["rows"]["dsio Checkpointer save (durable)"]["gbps_median"] == pytest.approx(
        (3 << 30) / 1.1 / 1e9
    )
    # each rep's pair side by side: the raw write's 2.0, 2.2, 2.1 s over the save's 1.0, 1.2, 1.1 s
    paired = data["paired_ratios"]["dsio Checkpointer save (durable) vs dsio raw write (new file, ceiling)"]
    assert paired == pytest.approx([2.0, 2.2 / 1.2, 2.1 / 1.1])
    assert data["order"] == b.order


# -- bench/summary.py ------------------------------------------------------------------------------
def test_summary_picks_the_run_recorded_newest_not_the_newest_file(tmp_path):
    summary = pytest.importorskip("bench.summary")
    old, new = tmp_path / "checkpoint-2026-11-30.md", tmp_path / "checkpoint-2026-11-30-run-under-load.md"
    old.write_text("# dsio.checkpoint benchmark, 2026-11-30 06:23 UTC\n\nquiet run\n")
    new.write_text("# dsio.checkpoint benchmark, 2026-11-30 06:04 UTC\n\nunder load\n")
    now = time.time()
    os.utime(old, (now - 3600, now - 3600))  # the older file on disk holds the newer run
    os.utime(new, (now, now))
    assert summary.newest(str(tmp_path), "checkpoint-*.md") == str(old)
    assert summary.recorded_date(str(old)) == "2026-11-30 06:23"


def test_summary_prefers_a_timed_record_and_ignores_undated_files(tmp_path):
    summary = pytest.importorskip("bench.summary")
    (tmp_path / "metrics-2026-11-29.md").write_text("# dsio.metrics overhead, 2026-11-29\n")
    (tmp_path / "metrics-2026-11-30.md").write_text("# dsio.metrics overhead, 2026-11-30\n")
    (tmp_path / "metrics-notes.md").write_text("# no date here\n")
    assert os.path.basename(summary.newest(str(tmp_path), "metrics-*.md")) == "metrics-2026-11-30.md"
    assert summary.recorded_date(str(tmp_path / "metrics-notes.md")) is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", summary.recorded_date(str(tmp_path / "metrics-2026-11-29.md")))


def test_io_seq_block_says_warm_when_the_run_could_not_drop_the_cache():
    src = json.loads((ROOT / "bench/results/2026-11-30-vm-io-quiet.json").read_text())
    src["cold"] = False
    assert "WARM reads" in rn.render_io_seq(src, "x.json")
    src["cold"] = True
    assert "page cache dropped before every read" in rn.render_io_seq(src, "x.json")


def test_bench_checkpoint_swaps_each_ceiling_and_its_dsio_method_every_other_rep():
    ck = pytest.importorskip("bench.checkpoint")
    steps = [(n, None) for n, _ in ck.SAVES + ck.LOADS]
    even, odd = ck.rep_order(steps, 0), ck.rep_order(steps, 1)
    assert even == steps
    names = [n for n, _ in odd]
    for a, b in ck.PAIRS:
        i, j = [n for n, _ in steps].index(a), [n for n, _ in steps].index(b)
        assert names[i] == b and names[j] == a  # swapped in place
    assert sorted(names) == sorted(n for n, _ in steps)  # nothing else moved or lost
    assert [n for n in names if n not in {x for p in ck.PAIRS for x in p}] == [
        n for n, _ in steps if n not in {x for p in ck.PAIRS for x in p}
    ]
