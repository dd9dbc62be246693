"""`spire throughput` options beyond the skeleton and `spire throughput-figures`."""

import csv
import io
import json

import pytest

from spire.cli import main

from tests.test_throughput_extensions import MISTRAL_7B


def run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


def test_json_contract_keeps_skeleton_fields_and_adds_new_ones(capsys):
    code, out, _ = run(capsys, "throughput", "--preset", "llama3-70b", "-B", "64", "-L", "8192", "--format", "json",
                       "--cost-analysis", "--grow", "8")
    payload = json.loads(out)
    assert code == 0 and payload["preset"] == "llama3-70b" and payload["hoi"] == 600
    assert [round(r["multiplier"], 2) for r in payload["rows"]] == [1.28, 1.27, 2.25]
    for r in payload["rows"]:
        assert {"draft", "B", "L", "tau", "delta_t", "multiplier", "saving_units", "growing_multiplier"} <= r.keys()


def test_csv(capsys):
    code, out, _ = run(capsys, "throughput", "-B", "64", "-L", "512", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [r["draft"] for r in rows] == ["vanilla", "magicdec", "spire"]
    assert [round(float(r["multiplier"]), 2) for r in rows] == [1.36, 2.05, 2.78]


def test_hardware_dtype_and_memory(capsys):
    code, out, _ = run(capsys, "throughput", "--preset", "llama3-70b", "--hardware", "h100-sxm", "--dtype", "bf16",
                       "-B", "1", "-L", "8", "--format", "json")
    payload = json.loads(out)
    assert code == 0 and payload["memory_bytes"] == 80e9 and payload["weight_bytes"] == 2
    assert payload["hoi"] == pytest.approx(989 / 3.35)
    assert [r["fits"] for r in payload["rows"]] == [False, False, False]  # 137 GB of bf16 weights
    code, out, _ = run(capsys, "throughput", "--flops", "1e15", "--bandwidth", "2e12", "-L", "512", "--format", "json")
    payload = json.loads(out)
    assert payload["hoi"] == 500 and payload["memory_bytes"] is None
    assert payload["rows"][0]["ad_tokens_per_s"] == pytest.approx(64 * 2e12 / (67_117_056 + 64 * 512 * 16_384))


def test_hf_config_mixed_batch_and_best_k(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MISTRAL_7B))
    code, out, _ = run(capsys, "throughput", "--config", str(config), "--spire-layers", "8", "--contexts",
                       "100,2000,700", "--alpha", "spire=0.9", "--best-k", "8", "--format", "json")
    payload = json.loads(out)
    assert code == 0 and payload["target_body_params"] == 6_979_584_000
    spire = payload["rows"][2]
    assert (spire["B"], spire["L"], spire["contexts"]["max"]) == (3, 933, 2000)
    assert spire["tau"] == pytest.approx((1 - 0.9**5) / 0.1) and 1 <= spire["best_k"] <= 8
    code, out, _ = run(capsys, "throughput", "--context-dist", "lognormal:median=512,sigma=1", "-B", "16",
                       "--format", "json")
    assert code == 0 and json.loads(out)["rows"][0]["B"] == 16


def test_table_shows_extra_columns(capsys):
    code, out, _ = run(capsys, "throughput", "-B", "64", "-L", "512", "--cost-analysis", "--hardware", "h100-sxm")
    assert code == 0 and "saving" in out and "SD tok/s" in out and "6.15" in out


@pytest.mark.slow
def test_throughput_figures(capsys, tmp_path):
    code, out, _ = run(capsys, "throughput-figures", "--out", str(tmp_path))
    assert code == 0 and "+104.1 % vs vanilla" in out and "+35.4 % vs MagicDec" in out
    data = json.loads((tmp_path / "figures.json").read_text())
    assert data["figure3"]["L_crit"] == 54
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == sorted(data["files"]) and len(pngs) == 7
    assert all((tmp_path / p).read_bytes().startswith(b"\x89PNG") for p in pngs)
    assert not list(tmp_path.glob(".*"))  # no temp files left


@pytest.mark.parametrize(
    "args, match",
    [
        (["--hardware", "v100"], "unknown hardware 'v100'"),
        (["--dtype", "fp7"], "unknown dtype 'fp7'"),
        (["--flops", "1e15"], "needs both --flops"),
        (["--config", "/nonexistent/config.json"], "cannot read"),
        (["--tau", "spire=0.5"], "tau for spire"),
        (["--alpha", "spire=2"], "alpha must be a number in [0, 1]"),
        (["--contexts", "5,-1"], "context length must be a positive integer"),
        (["--memory-gb", "-1"], "--memory-gb must be positive"),
        (["--bytes-per-value", "-2"], "--bytes-per-value must be positive, got -2.0"),
        (["--draft-window", "0"], "window must be a positive integer"),
        (["--grow", "0"], "G must be a positive integer"),
        (["--context-dist", "zipf:a=2"], "unknown context distribution"),
        (["--spire-layers", "99"], "--spire-layers must be in [1, 8]"),
    ],
)
def test_bad_input_one_error_line(capsys, args, match):
    code, out, err = run(capsys, "throughput", "-L", "512", *args, "--format", "json")
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err and "Traceback" not in err


def test_bad_hf_config_file(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({k: v for k, v in MISTRAL_7B.items() if k != "intermediate_size"}))
    code, _, err = run(capsys, "throughput", "--config", str(config))
    assert code == 2 and err == "error: model config lacks the key 'intermediate_size'\n"
