"""bench/disk_bw.py on a small scratch file: every mode and depth measured, its records checked, the file removed."""

from __future__ import annotations

import json

from bench import disk_bw
from tests.offload.test_disk import o_direct_opens


def test_a_small_run_measures_every_mode_and_depth_and_leaves_no_file(tmp_path):
    scratch, out = tmp_path / "scratch.bin", tmp_path / "r.json"
    assert disk_bw.main(["--file", str(scratch), "--experts", "6", "--expert-bytes", "300000", "--depths", "1,3", "--reps", "1",
                         "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert not scratch.exists()
    assert r["file_bytes"] == disk_bw.SKEW + 6 * 300000 + disk_bw.ALIGN // 2 and r["machine"]["filesystem"]["type"] != "?"
    scratch.write_bytes(b"x")
    direct = o_direct_opens(scratch)  # False on a filesystem that refuses it: then the reader falls back
    rows = r["gbs_by_reads_in_flight"]
    assert set(rows) == set(disk_bw.MODES) and all(set(rows[m]) == {"1", "3"} for m in rows)
    for mode, by_depth in rows.items():
        for row in by_depth.values():
            assert row["best_gbs"] >= row["median_gbs"] > 0
            assert row["read_direct"] == (mode == "o_direct" and direct)
            # records 8 bytes past a block boundary into an arena aligned at 0: O_DIRECT bounces all of it
            assert row["bounced_share"] == (1.0 if row["read_direct"] else 0.0)


def test_aligned_records_are_read_straight_into_the_slots(tmp_path):
    """--offset-skew 0 with records a multiple of the block: O_DIRECT bounces nothing (where the filesystem has it)."""
    scratch, out = tmp_path / "scratch.bin", tmp_path / "r.json"
    assert disk_bw.main(["--file", str(scratch), "--experts", "4", "--expert-bytes", str(64 * 4096), "--depths", "2",
                         "--reps", "1", "--offset-skew", "0", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["offset_skew"] == 0 and r["file_bytes"] == 4 * 64 * 4096 + disk_bw.ALIGN // 2
    scratch.write_bytes(b"x")
    direct = o_direct_opens(scratch)
    row = r["gbs_by_reads_in_flight"]["o_direct"]["2"]
    assert row["read_direct"] == direct and row["bounced_share"] == 0.0 and row["best_gbs"] > 0
