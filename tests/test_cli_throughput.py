"""`spire throughput`: the JSON contract, option parsing and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spire.cli import main


def run(capsys, *args: str) -> tuple[int, str, str]:
    """Run the CLI entry point in-process; (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["throughput", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["console script", "python -m spire"])
def test_console_script_json_contract(entry):
    script = Path(sys.executable).with_name("spire")
    if entry == "console script":
        command = [str(script)] if script.exists() else [sys.executable, "-m", "spire.cli"]
    else:
        command = [sys.executable, "-m", "spire"]
    result = subprocess.run(
        [*command, "throughput", "--preset", "paper-67m", "-B", "64", "-L", "512", "--format", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    payload = json.loads(result.stdout)  # exactly one JSON object
    rows = payload["rows"]
    assert [r["draft"] for r in rows] == ["vanilla", "magicdec", "spire"]
    for r in rows:
        assert {"draft", "B", "L", "tau", "delta_t", "multiplier"} <= r.keys()
        assert (r["B"], r["L"]) == (64, 512)
    assert [round(r["multiplier"], 2) for r in rows] == [1.36, 2.05, 2.78]


def test_repeated_and_comma_separated_grid(capsys):
    code, out, _ = run(capsys, "-B", "1,8", "-B", "64", "-L", "256", "-L", "512,1024", "--format", "json")
    assert code == 0
    rows = json.loads(out)["rows"]
    assert sorted({r["B"] for r in rows}) == [1, 8, 64]
    assert sorted({r["L"] for r in rows}) == [256, 512, 1024]
    assert len(rows) == 3 * 3 * 3


def test_options_reach_the_model(capsys):
    args = ["-B", "64", "-L", "512", "--tau", "spire=3.0", "--tau", "vanilla=2", "--k", "3", "--hoi", "300"]
    code, out, _ = run(capsys, *args, "--combine", "sum", "--format", "json")
    payload = json.loads(out)
    assert code == 0 and (payload["k"], payload["hoi"], payload["combine"]) == (3, 300, "sum")
    taus = {r["draft"]: r["tau"] for r in payload["rows"]}
    assert taus == {"vanilla": 2.0, "magicdec": 3.891, "spire": 3.0}


def test_memory_gb_marks_points_that_do_not_fit(capsys):
    code, out, _ = run(capsys, "-B", "64", "-L", "512,8192", "--memory-gb", "2", "--format", "json")
    rows = json.loads(out)["rows"]
    assert code == 0
    assert all(r["fits"] and r["multiplier"] for r in rows if r["L"] == 512)
    assert all(r["fits"] is False and r["multiplier"] is None for r in rows if r["L"] == 8192)
    code, out, _ = run(capsys, "-B", "64", "-L", "8192", "--memory-gb", "2")
    assert "does not fit" in out


def test_table_and_plot(capsys, tmp_path):
    plot = tmp_path / "heat.png"
    code, out, err = run(capsys, "-B", "64", "-L", "512", "--plot", str(plot))
    assert code == 0
    assert "spire" in out and "2.78" in out and "1.36" in out
    assert plot.read_bytes().startswith(b"\x89PNG") and str(plot) in err


@pytest.mark.parametrize(
    "args, match",
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["-B", "0"], "B must be a positive integer"),
        (["-B", "4,x"], "-B: 'x' is not an integer"),
        (["-L", "-5"], "L must be a positive integer"),
        (["--k", "0"], "k must be a positive integer"),
        (["--tau", "eagle=2"], "unknown draft 'eagle'"),
        (["--tau", "spire"], "--tau expects DRAFT=VALUE"),
        (["--tau", "spire=abc"], "--tau expects DRAFT=VALUE"),
        (["--tau", "spire=9"], "tau for spire"),
        (["--memory-gb", "0"], "--memory-gb must be positive"),
    ],
)
def test_bad_input_is_one_error_line(capsys, args, match):
    code, out, err = run(capsys, *args, "--format", "json")
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err
    assert "Traceback" not in err


def test_usage_error_exits_non_zero(capsys):
    code, _, err = run(capsys, "--combine", "avg")
    assert code != 0 and "Traceback" not in err


def test_zero_is_not_unset_and_outputs_are_checked_first(capsys, tmp_path):
    """--spire-layers 0 and --bytes-per-value 0 are refused (they read as "not given" and printed the defaults);
    a --plot under a file, or --out naming a file, is refused before any work, in one line."""
    afile = tmp_path / "afile"
    afile.write_text("keep")
    cases = [(["throughput", "--spire-layers", "0", "-B", "1", "-L", "512"], "--spire-layers must be in [1, "),
             (["throughput", "--bytes-per-value", "0", "-B", "1", "-L", "512"], "--bytes-per-value must be positive"),
             (["throughput", "--plot", str(afile / "x.png"), "-B", "1", "-L", "512"], f"{afile} is a file, not a folder"),
             (["throughput-figures", "--out", str(afile)], "is a file, not a folder"),
             (["bench", "--quick", "--out", str(afile)], "is a file, not a folder"),
             (["throughput", "--preset", "smollm2-135m", "-B", "64", "-L", "512,9000"],
              "L=9000 exceeds smollm2-135m's 8192 positions"),
             (["throughput", "--preset", "smollm2-135m", "-B", "64", "--contexts", "100,8193"],
              "L=8193 exceeds smollm2-135m's 8192 positions")]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert afile.read_text() == "keep"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc, where no file can be created")
@pytest.mark.parametrize("argv", [["tau", "--draft", "magicdec", "--out", "/proc/x.json"],
                                  ["reproduce", "--quick", "--out", "/proc/x/out"],
                                  ["bench", "--quick", "--out", "/proc/x"],
                                  ["throughput-figures", "--out", "/proc/x"]])
def test_unwritable_out_is_refused_before_any_work(capsys, argv):
    """An --out where nothing can be written is refused in one line before any measurement (it used to fail at
    the end, naming a temporary file)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cannot write in /proc" in err and len(err.strip().splitlines()) == 1, err


def test_out_that_is_a_device_or_pipe_is_refused(tmp_path, capsys):
    """A rename over /dev/full (or a FIFO) replaced the device with a regular file: refused up front, and
    atomic_write itself never renames over a non-regular file."""
    import os

    from spire.errors import ConfigError
    from spire.paths import atomic_write, check_output_path

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a regular file"):
        check_output_path(fifo, "--out")
    with pytest.raises(ConfigError, match="is not a regular file"):
        atomic_write(fifo, None, "x")
    assert not fifo.is_file() and fifo.exists()  # still the pipe
    with pytest.raises(SystemExit) as e:
        main(["tau", "--draft", "magicdec", "--out", str(fifo)])
    assert e.value.code == 2 and "is not a regular file" in capsys.readouterr().err


def test_caption_says_where_each_drafts_tau_came_from(capsys):
    code, out, err = run(capsys, "--preset", "smollm2-135m", "-B", "64", "-L", "512", "--tau", "spire=2.2")
    assert code == 0, err
    flat = " ".join(out.split())
    assert "τ of vanilla, magicdec: the paper's 67M-target values" in flat and "of spire: override" in flat


def test_output_check_creates_nothing(tmp_path):
    from spire.paths import check_output_path

    assert check_output_path(tmp_path / "a" / "b", "--out", folder=True) == tmp_path / "a" / "b"
    assert check_output_path(tmp_path / "r.json", "--out") == tmp_path / "r.json"
    assert list(tmp_path.iterdir()) == []
