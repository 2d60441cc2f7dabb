"""bench.hlo_top_kernels ranks a module's kernels by the roofline's time per step."""
from bench.hlo_top_kernels import main, ranked
from tests.plan.test_plan_hlo import DOT, LOOP


def test_kernels_are_ranked_by_time_per_step_and_loops_only_drops_the_entry():
    rows = ranked(LOOP, "b200")
    times = [t for t, _ in rows]
    assert times == sorted(times, reverse=True) and all(k.looped for _, k in rows)
    assert rows[0][1].name == "gemm"  # the loop's GEMM, 4 launches, outweighs its compare
    assert ranked(DOT, "b200", loops_only=True) == [] and len(ranked(DOT, "b200")) == 1


def test_the_command_prints_a_table(tmp_path, capsys):
    path = tmp_path / "m.hlo.txt"
    path.write_text(LOOP)
    assert main([str(path), "--gpu", "b200", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "| gemm |" in out and out.count("\n| ") == 3  # header and two rows
