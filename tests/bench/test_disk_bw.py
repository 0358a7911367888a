"""bench/disk_bw.py on a small scratch file: every mode and depth measured, its records checked, the file removed; decode's
pattern into slots congruent to the file offsets (only heads and tails bounced) and a byte off (all bounced)."""

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
    mem = r["dio_alignment"]["mem_align"]
    assert r["dio_alignment"]["direct"] == direct
    for mode, by_depth in rows.items():
        for row in by_depth.values():
            assert row["best_gbs"] >= row["median_gbs"] > 0
            assert row["read_direct"] == (mode == "o_direct" and direct)
            if not row["read_direct"]:
                assert row["bounced_share"] == row["straight_share"] == 0.0
            elif disk_bw.SKEW % mem:  # records 8 bytes past a block into slots aligned at 0: all of it bounces
                assert row["bounced_share"] == 1.0 and row["straight_share"] == 0.0
            else:  # a memory alignment dividing 8 (NVMe's 4): only each record's head and tail, two blocks at most
                assert row["bounced_share"] <= 2 * disk_bw.ALIGN / 300000 and row["bounced_share"] + row["straight_share"] == 1.0


def test_decode_pattern_into_congruent_slots_bounces_only_heads_and_tails(tmp_path):
    scratch, out = tmp_path / "scratch.bin", tmp_path / "r.json"
    assert disk_bw.main(["--file", str(scratch), "--experts", "4", "--expert-bytes", "300000", "--depths", "1", "--reps", "1",
                         "--decode-pieces-kb", "64,16", "--decode-per-submit", "1,2", "--decode-threads", "2", "--huge-pages",
                         "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["huge_pages"]
    decode = r["decode_pattern"]["gbs_by_destination_piece_kb_and_experts_per_submit"]
    assert set(decode) == set(disk_bw.DESTINATIONS) and all(set(d) == {"64", "16"} and set(d["64"]) == {"1", "2"} for d in decode.values())
    direct, mem = r["dio_alignment"]["direct"], r["dio_alignment"]["mem_align"]
    for name, by_piece in decode.items():
        for row in (row for by_n in by_piece.values() for row in by_n.values()):
            assert row["best_gbs"] >= row["median_gbs"] > 0
            if not direct:
                assert row["bounced_share"] == row["straight_share"] == 0.0
            elif name == "congruent":  # three projections of 100,000 bytes: each its head and tail at most
                assert row["bounced_share"] <= 3 * 2 * disk_bw.ALIGN / 300000 and row["straight_share"] > 0.9
                assert row["bounced_share"] + row["straight_share"] == 1.0
            elif mem > 1:
                assert row["bounced_share"] == 1.0


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
    assert row["straight_share"] == (1.0 if direct else 0.0)
