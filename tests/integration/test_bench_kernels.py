"""fusion-bench-kernels: one block, op by op, against a stream and datasheet peaks.

On the CPU backend with a tiny block: every decode and prefill size prints a line whose figures
follow from the block's shapes (the matmuls' GB/s are the weights' bytes over their time, the
fractions are those GB/s and TFLOP/s over the peaks given), each type ends with its efficiency
line, and bad options or a device that cannot be used are refused with a message, never a crash.
"""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("FUSION_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD = Path(os.environ.get("FUSION_BUILD_DIR", ROOT / "build"))
# the tiny block: dim 256, 4 heads and 2 KV heads of 64, ffn 512 (q, k, v, o, gate, up, down)
TINY_PARAMS = 256 * 256 + 2 * 128 * 256 + 256 * 256 + 3 * 512 * 256
BYTES_PER_PARAM = {"f16": 2.0, "q4_0": 18 / 32}


def bench(*args):
    return subprocess.run([str(BUILD / "fusion-bench-kernels"), *args], capture_output=True, text=True,
                          timeout=300)


def test_tiny_block_on_the_cpu():
    out = bench("--device", "cpu", "--threads", "2", "--block", "tiny", "--types", "f16,q4_0", "--decode-t", "1,4",
                "--prefill-t", "32", "--context", "64", "--min-s", "0.01", "--stream-mib", "8", "--peak-gbs", "100",
                "--peak-tflops", "2")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert re.search(r"^device: cpu \(", text, re.M)
    assert "block: tiny: dim 256, heads 4/2 of 64, ffn 512" in text
    stream = float(re.search(r"^stream: op_add over 2 x 8 MiB: ([\d.]+) GB/s", text, re.M).group(1))
    assert stream > 0
    for typ in ("f16", "q4_0"):
        decode = re.findall(rf"^decode  {typ} +T=(\d+) +ctx 64: block +([\d.]+) ms \| matmuls +([\d.]+) ms +([\d.]+) "
                            r"GB/s = ([\d.]+) of peak 100 = ([\d.]+) of stream \| attention +([\d.]+) ms", text, re.M)
        assert [int(d[0]) for d in decode] == [1, 4]
        for t, block, mm, gbs, frac, of_stream, attn in decode:
            mm, gbs = float(mm), float(gbs)
            assert float(block) > 0 and mm > 0 and float(attn) > 0
            nbytes = TINY_PARAMS * BYTES_PER_PARAM[typ]  # the ms are printed to 0.001
            assert nbytes / (mm + 5e-4) * 1e-6 - 0.1 <= gbs <= nbytes / max(mm - 5e-4, 1e-4) * 1e-6 + 0.1
            assert float(frac) == pytest.approx(gbs / 100, abs=2e-3)
            assert float(of_stream) == pytest.approx(gbs / stream, rel=0.02, abs=2e-3)
        pre = re.search(rf"^prefill {typ} +T=32 +: block +([\d.]+) ms \| matmuls +([\d.]+) ms +([\d.]+) TFLOP/s = "
                        r"([\d.]+) of peak 2 \| attention +([\d.]+) ms +([\d.]+) TFLOP/s$", text, re.M)
        assert pre, text
        flop, mm = 2 * TINY_PARAMS * 32, float(pre.group(2))
        assert flop / (mm + 5e-4) * 1e-9 - 0.01 <= float(pre.group(3)) <= flop / max(mm - 5e-4, 1e-4) * 1e-9 + 0.01
        attn_flop, at = 4 * 64 * 4 * 32 * 33 / 2, float(pre.group(5))  # 4 * hd * H per position attended
        assert attn_flop / (at + 5e-4) * 1e-9 - 0.001 <= float(pre.group(6)) <= attn_flop / max(at - 5e-4, 1e-4) * 1e-9 + 0.001
        eff = re.search(rf"^efficiency {typ} bandwidth ([\d.]+) flops ([\d.]+) \(matmuls: decode T=1 of the peak, "
                        r"prefill T=32 of the peak\)$", text, re.M)
        assert eff, text
        assert float(eff.group(1)) == pytest.approx(float(decode[0][4]), abs=2e-3)
        assert float(eff.group(2)) == pytest.approx(float(pre.group(4)), abs=2e-3)


@pytest.mark.parametrize("args, code, message", [
    (["--types", "i8"], 1, "no weight type 'i8'"),
    (["--types", "f16,bogus"], 1, "no weight type 'bogus'"),
    (["--decode-t", "0"], 2, "outside [1, 4096]"),
    (["--block", "llama-9"], 2, "block"),
    (["--device", "tpu"], 1, "tpu"),
])
def test_bad_options_refused(args, code, message):
    out = bench("--block", "tiny", "--min-s", "0.01", "--stream-mib", "8", "--decode-t", "1", "--prefill-t", "8",
                *args)
    assert out.returncode == code, (out.stdout, out.stderr)
    assert message in out.stderr
    assert "Traceback" not in out.stderr and "Sanitizer" not in out.stderr


def test_cuda_without_a_gpu_is_refused_or_runs():
    out = bench("--device", "cuda", "--block", "tiny", "--types", "f16", "--decode-t", "1", "--prefill-t", "8",
                "--context", "16", "--min-s", "0.01", "--stream-mib", "8")
    if out.returncode == 0:  # a machine with a usable GPU
        assert re.search(r"^efficiency f16 bandwidth [\d.]+ flops 0\.000", out.stdout, re.M)
    else:
        assert out.returncode == 1 and out.stderr.startswith("fusion-bench-kernels: ")


def test_help_names_every_option():
    out = bench("--help")
    assert out.returncode == 0
    for opt in ("--device", "--threads", "--block", "--types", "--decode-t", "--prefill-t", "--context", "--peak-gbs",
                "--peak-tflops", "--min-s", "--stream-mib"):
        assert opt in out.stdout, opt
